"""`gpuwise serve`: a trained run behind an HTTP API (FastAPI on uvicorn), with dynamic batching."""
