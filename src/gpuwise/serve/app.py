"""The HTTP API: FastAPI routes for the served workload, its limits, its key and its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import FastAPI, File, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from gpuwise.serve.batcher import DynamicBatcher, ServeMetrics
from gpuwise.serve.models import ClientError, Limits


@dataclass
class Settings:
    run_dir: str
    runtime: str = "torch"
    max_batch: int = 32
    max_wait_ms: float = 5.0
    api_key: str | None = None
    limits: Limits = None

    def __post_init__(self):
        self.limits = self.limits or Limits()


class Prediction(BaseModel):
    file: str
    probability: float = Field(description="Probability of the positive class")
    label: str


class PredictResponse(BaseModel):
    predictions: list[Prediction]


class RecommendRequest(BaseModel):
    user: str | int
    k: int = Field(10, description="Items to return (at most the server's --max-k)")
    exclude_seen: bool = Field(True, description="Leave out items the user interacted with in training")


class Item(BaseModel):
    item: str
    title: str | None = None
    score: float | None = Field(None, description="Model score; none for popular items")


class RecommendResponse(BaseModel):
    user: str
    source: str = Field(description="'model', or 'popular' for a user the model has not seen")
    items: list[Item]


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0, le=5, description="0: greedy")
    top_p: float = Field(0.95, gt=0, le=1)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=4)
    stream: bool = Field(False, description='Server-sent events: data: {"text": ...} per piece, then data: [DONE]')


class GenerateResponse(BaseModel):
    text: str
    tokens: int
    finish_reason: str


class Info(BaseModel):
    workload: str
    model: str
    device: str
    precision: str
    run_id: str
    runtime: str
    max_batch: int
    max_wait_ms: float
    limits: dict


def _error(status: int, message: str, **headers) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status, headers=headers or None)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """413 for a body over the limit, counted as it arrives (a wrong or absent Content-Length too)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            return await _error(413, f"request body over the limit of {self.max_bytes:,} bytes")(scope, receive, send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if not started:
                await _error(413, f"request body over the limit of {self.max_bytes:,} bytes")(scope, receive, send)


def create_app(served, settings: Settings, run_id: str, precision: str) -> FastAPI:
    limits, metrics = settings.limits, ServeMetrics()
    batcher = DynamicBatcher(served, settings.max_batch, settings.max_wait_ms, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        if served.workload != "product-lm":
            await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(
        title=f"gpuwise serve: {served.workload}",
        description=f"Run {run_id} ({served.model_name}) on {served.device}.",
        lifespan=lifespan,
    )
    key = settings.api_key.encode() if settings.api_key else None

    @app.middleware("http")
    async def guard_and_measure(request: Request, call_next):
        start = time.perf_counter()
        if key is not None:
            given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), key):  # constant time: no timing oracle on the key
                response = _error(401, "missing or wrong API key (X-API-Key or Authorization: Bearer)")
                response.headers["WWW-Authenticate"] = "Bearer"
                metrics.requests.labels("any", "401").inc()
                return response
        response = await call_next(request)
        route = request.scope.get("route")  # the route's template, so a scan of random paths adds no series
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    @app.exception_handler(ClientError)
    async def client_error(_, e: ClientError):
        return _error(e.status, e.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return _error(422, f"{where}: {first['msg']}")

    async def answer(items: list):
        try:
            return await asyncio.wait_for(batcher.submit(items), limits.timeout_s)
        except TimeoutError:
            raise ClientError(504, f"no answer within the {limits.timeout_s:g} s request timeout") from None

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "workload": served.workload}

    @app.get("/v1/info", response_model=Info)
    async def info() -> Info:
        return Info(
            workload=served.workload,
            model=served.model_name,
            device=served.device + (" (onnxruntime)" if settings.runtime == "onnx" else ""),
            precision=precision,
            run_id=run_id,
            runtime=settings.runtime,
            max_batch=settings.max_batch,
            max_wait_ms=settings.max_wait_ms,
            limits=asdict(limits),
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if served.workload == "defects":

        @app.post("/v1/predict", response_model=PredictResponse)
        async def predict(file: Annotated[list[UploadFile], File(description="PNG or JPEG, repeatable")]):
            if len(file) > limits.max_images:
                raise ClientError(413, f"{len(file)} images; at most {limits.max_images} per request")
            images = [served.decode(await f.read(), f.filename or f"file {n + 1}") for n, f in enumerate(file)]
            results = await answer(images)
            return PredictResponse(
                predictions=[Prediction(file=f.filename or "", **r) for f, r in zip(file, results, strict=True)]
            )

    if served.workload == "recommender":

        @app.post("/v1/recommend", response_model=RecommendResponse)
        async def recommend(ask: RecommendRequest):
            if not 1 <= ask.k <= limits.max_k:
                raise ClientError(422, f"k: must be between 1 and {limits.max_k}")
            user = str(ask.user)
            if user not in served.user_index:
                return RecommendResponse(user=user, source="popular", items=served.popular_items(ask.k))
            [items] = await answer([(served.user_index[user], ask.k, ask.exclude_seen)])
            return RecommendResponse(user=user, source="model", items=items)

    if served.workload == "product-lm":

        @app.post("/v1/generate", response_model=GenerateResponse)
        async def generate(ask: GenerateRequest):
            if ask.max_tokens > limits.max_tokens:
                raise ClientError(422, f"max_tokens: at most {limits.max_tokens}")
            if len(ask.prompt) > limits.max_prompt_chars:
                raise ClientError(413, f"prompt: {len(ask.prompt):,} characters; at most {limits.max_prompt_chars:,}")
            args = (ask.prompt, ask.max_tokens, ask.temperature, ask.top_p, ask.stop)
            if not ask.stream:
                try:
                    result = await asyncio.wait_for(asyncio.to_thread(served.generate, *args), limits.timeout_s)
                except TimeoutError:
                    raise ClientError(504, f"no answer within the {limits.timeout_s:g} s request timeout") from None
                return GenerateResponse(**result)
            pieces = served.stream(*args)  # checks the prompt (a 4xx) before the stream starts

            async def events():
                while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                    yield f"data: {json.dumps({'text': piece})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

    return BodyLimit(app, limits.max_body_bytes)
