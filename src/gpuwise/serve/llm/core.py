"""Causal LMs behind the OpenAI API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`) and gpuwise's own
`/v1/generate`, over any engine: each loaded base (with the LoRA adapters that share it) is a `Backend`
(serve/engines/base.py) with its own engine, and the request's `model` field picks the base and adapter.

The LitServe shape, a module each: decode (the request -> prompt token ids and sampling parameters,
`decode.py`), predict (the engine, shared by every request, `stream.py`), encode (events -> OpenAI's JSON, whole
or as server-sent events, `api.py`). `metrics.py` holds the Prometheus series."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from gpuwise.serve.engines.base import Backend, EngineClient, Params
from gpuwise.serve.llm import api, decode, metrics, stream
from gpuwise.serve.llm.session import Session
from gpuwise.workloads.serving import ClientError, Limits, ServeContext


class LLM:
    """Language models behind the OpenAI API. `backends`: [(backend, [(model id, adapter)])]; an adapter name
    picks a LoRA adapter of that backend's base, None the base itself. `engine_line` says which engine serves
    and why: the first line of the start-up plan."""

    batched = False

    def __init__(
        self,
        backends: list[tuple[Backend, list[tuple[str, str | None]]]],
        limits: Limits,
        precision: str,
        device: str,
        engine_line: str,
        workload: str = "llm",
        about: str = "",
    ):
        self.limits, self.workload, self.device, self.precision = limits, workload, device, precision
        self.engine_line = engine_line
        self.created = int(time.time())
        self.backends = [b for b, _ in backends]
        self.route: dict[str, tuple[Backend, str | None]] = {}
        for backend, names in backends:
            for name, adapter in names:
                self.route[name] = (backend, adapter)
        self.names = list(self.route)
        self.session = Session()  # what it served, for the record when it stops
        self.startup: dict[str, Any] | None = None  # the goodput planned at start (plan/endpoint.py), for /v1/info
        self.model_name = ", ".join(self.names) + (f" ({about})" if about else "")

    # the first backend, for the one-model case (the start-up plan, `gpuwise chat`)
    @property
    def engine(self) -> EngineClient:
        return self.backends[0].engine

    @property
    def tok(self):
        return self.backends[0].tok

    def plan(self) -> str:
        return "\n".join([self.engine_line, *(b.plan() for b in self.backends)])

    def __call__(self, items: list, /) -> list:
        raise NotImplementedError("an LLM is not served through the dynamic batcher: its engine batches")

    def close(self) -> None:
        for b in self.backends:
            b.close()

    def health(self) -> str | None:
        """None while every engine can answer; else why not."""
        return next((why for b in self.backends if (why := b.engine.health())), None)

    def routes(self, ctx: ServeContext) -> None:
        metrics.register(self.backends, ctx.registry, self.session)
        api.add_routes(self, ctx)

    # --- what the OpenAI front asks -----------------------------------------------------------------
    def model(self, name: str) -> tuple[Backend, str | None]:
        """The backend and adapter a request's `model` names; a 404 for one this server does not serve."""
        if name not in self.route:
            raise ClientError(404, f"model '{name}' not found; this server serves: {', '.join(self.names)}")
        return self.route[name]

    def decode_chat(self, body: bytes) -> decode.Decoded:
        return decode.chat(self, body)

    def decode_completion(self, body: bytes) -> decode.Decoded:
        return decode.completion(self, body)

    def decode_generate(self, body: bytes) -> decode.Decoded:
        return decode.generate(self, body)

    def submit(self, target: tuple[Any, str | None], ids: list[int], params: Params) -> stream.Stream:
        return stream.submit(target, ids, params, self.limits)

    def events(self, submitted: stream.Stream, request: Request | None) -> AsyncIterator[dict]:
        return stream.events(submitted, request)

    async def whole(self, submitted: stream.Stream, request: Request) -> tuple[str, dict]:
        return await stream.whole(submitted, request, self.limits)
