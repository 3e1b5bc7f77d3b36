"""gpuwise's own engine: continuous batching (`engine`), its KV caches (`kvcache`), the fused Llama-family forward
(`decoder`), the CPU decode kernels (`attention` + `kernels/`), weights packed for oneDNN or MKL (`packed`), and
the backend that puts them behind the OpenAI front (`backend`)."""
