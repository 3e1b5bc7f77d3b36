"""The OpenAI API over `LLM` (vLLM's shape: a thin router over one serving class). Every text route takes
the same path, `OpenAIServing.respond`: the body parsed and tokenized on a worker thread, the sequence
submitted, and the engine's events written whole or as server-sent events by the route's `Wire`, which is
all that differs between chat, completions and gpuwise's own `/v1/generate`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import Request  # at module level: FastAPI resolves the routes' annotations here
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gpuwise.serve.llm import protocol as p
from gpuwise.workloads.serving import ServeContext

if TYPE_CHECKING:
    from gpuwise.serve.llm.core import LLM

DONE = "data: [DONE]\n\n"


def sse(obj: BaseModel | dict) -> str:
    body = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {body}\n\n"


def _usage(end: dict) -> p.Usage:
    a, b = end.get("prompt_tokens", 0), end.get("completion_tokens", 0)
    return p.Usage(prompt_tokens=a, completion_tokens=b, total_tokens=a + b)


class Wire:
    """How one route reads its request and writes its answer. `head` is what every chunk of one stream
    repeats (its id, creation time and model)."""

    def parse(self, llm: LLM, body: bytes) -> tuple[Any, Any, list[int], Any]:
        raise NotImplementedError

    def whole(self, ask, text: str, end: dict) -> BaseModel:
        raise NotImplementedError

    def head(self, ask) -> dict:
        return {}

    def opening(self, head: dict) -> list[str]:
        return []

    def piece(self, head: dict, text: str) -> str:
        raise NotImplementedError

    def closing(self, ask, head: dict, end: dict) -> list[str]:
        """The finish event, then the usage when the client asked for it (`stream_options.include_usage`)."""
        usage = [sse(self.chunk(head, [], _usage(end)))] if ask.usage_wanted() else []
        return [sse(self.chunk(head, [self.finished(end["finish"])])), *usage]

    def chunk(self, head: dict, choices: list, usage: p.Usage | None = None) -> BaseModel:
        raise NotImplementedError

    def finished(self, reason: str) -> BaseModel:
        raise NotImplementedError

    def error(self, status: int, message: str) -> str:
        """An error event for a stream that could not finish (OpenAI sends `data: {"error": ...}`)."""
        return sse(p.error_body(status, message))


class ChatWire(Wire):
    def parse(self, llm, body):
        return llm.decode_chat(body)

    def whole(self, ask, text, end):
        choice = p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=end["finish"])
        return p.ChatCompletion(model=ask.model, choices=[choice], usage=_usage(end))

    def head(self, ask):
        return dict(id=p.new_id("chatcmpl"), created=p.now(), model=ask.model)

    def opening(self, head):
        opened = p.ChunkChoice(delta=p.Delta(role="assistant", content=""))
        return [sse(p.ChatCompletionChunk(**head, choices=[opened]))]

    def piece(self, head, text):
        return sse(self.chunk(head, [p.ChunkChoice(delta=p.Delta(content=text))]))

    def chunk(self, head, choices, usage=None):
        return p.ChatCompletionChunk(**head, choices=choices, usage=usage)

    def finished(self, reason):
        return p.ChunkChoice(delta=p.Delta(), finish_reason=reason)


class CompletionWire(Wire):
    def parse(self, llm, body):
        return llm.decode_completion(body)

    def whole(self, ask, text, end):
        choice = p.CompletionChoice(text=text, finish_reason=end["finish"])
        return p.Completion(model=ask.model, choices=[choice], usage=_usage(end))

    def head(self, ask):
        return dict(id=p.new_id("cmpl"), created=p.now(), model=ask.model)

    def piece(self, head, text):
        return sse(self.chunk(head, [p.CompletionChoice(text=text)]))

    def chunk(self, head, choices, usage=None):
        return p.Completion(**head, choices=choices, usage=usage)

    def finished(self, reason):
        return p.CompletionChoice(text="", finish_reason=reason)


class GenerateWire(Wire):
    """gpuwise's own route, kept for the clients written against it before the OpenAI API."""

    def parse(self, llm, body):
        return llm.decode_generate(body)

    def whole(self, ask, text, end):
        return p.GenerateResponse(text=text, tokens=end["completion_tokens"], finish_reason=end["finish"])

    def piece(self, head, text):
        return sse({"text": text})

    def closing(self, ask, head, end):
        return []  # the stream ends with [DONE] alone

    def error(self, status, message):
        return sse({"error": message})


class OpenAIServing:
    """The one path every text route takes: parse, submit, then the answer whole or streamed."""

    def __init__(self, llm: LLM, ctx: ServeContext):
        self.llm, self.ctx = llm, ctx

    async def respond(self, wire: Wire, request: Request):
        llm = self.llm
        ask, target, ids, params = await run_in_threadpool(wire.parse, llm, await request.body())
        stream = llm.submit(target, ids, params)
        if not ask.stream:
            text, end = await llm.whole(stream, request)
            return wire.whole(ask, text, end)
        head = wire.head(ask)

        async def events():
            for event in wire.opening(head):
                yield event
            async for event in llm.events(stream, request):
                if "text" in event:
                    yield wire.piece(head, event["text"])
                elif (failure := self._failure(wire, event)) is not None:
                    yield failure
                elif event["finish"] in ("stop", "length"):
                    for closing in wire.closing(ask, head, event):
                        yield closing
            yield DONE

        # X-Accel-Buffering: nginx (and proxies that honour it) pass each event on as it comes
        return StreamingResponse(events(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})

    def _failure(self, wire: Wire, end: dict) -> str | None:
        if end["finish"] == "timeout":
            return wire.error(504, f"stopped at the {self.llm.limits.timeout_s:g} s request timeout")
        if end["finish"] == "error":
            self.ctx.log.error("generation failed: %s", end.get("error"))
            self.ctx.internal_errors.inc()
            return wire.error(500, "internal error (logged by the server)")
        return None


def body_of(kind: type[BaseModel]) -> dict:
    """The request body's schema for /docs (the routes read the body themselves, off the event loop), its
    $defs inlined: OpenAPI resolves a $ref from the document's root, not the schema's."""
    schema = kind.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            return inline(defs[ref.rsplit("/", 1)[1]]) if ref else {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def add_routes(llm: LLM, ctx: ServeContext) -> None:
    """The router: each route is one line over `OpenAIServing`."""
    app, serving = ctx.app, OpenAIServing(llm, ctx)
    chat, completion, generate = ChatWire(), CompletionWire(), GenerateWire()

    @app.get("/v1/models", response_model=p.ModelList)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=n, created=llm.created) for n in llm.names])

    @app.get("/v1/models/{name:path}", response_model=p.ModelCard)
    async def model(name: str) -> p.ModelCard:
        llm.model(name)
        return p.ModelCard(id=name, created=llm.created)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletion, openapi_extra=body_of(p.ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serving.respond(chat, request)

    @app.post("/v1/completions", response_model=p.Completion, openapi_extra=body_of(p.CompletionRequest))
    async def completions(request: Request):
        return await serving.respond(completion, request)

    @app.post("/v1/generate", response_model=p.GenerateResponse, openapi_extra=body_of(p.GenerateRequest))
    async def generate_text(request: Request):
        return await serving.respond(generate, request)
