"""Causal LMs behind the OpenAI API (`/v1/models`, `/v1/chat/completions`, `/v1/completions`) and
gpuwise's own `/v1/generate`: each loaded base (with the LoRA adapters that share it) runs in its own
continuous-batching `Engine`, and the request's `model` field picks the base and adapter.

The LitServe shape: decode (the request -> prompt token ids and sampling parameters), predict (the
engine, shared by every request), encode (events -> OpenAI's JSON, whole or as server-sent events).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Request  # at module level: FastAPI resolves the routes' annotations here
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from gpuwise.serve import protocol as p
from gpuwise.serve.decoder import fused_decoder
from gpuwise.serve.engine import (
    GREEDY_BELOW,
    Engine,
    EngineStats,
    Params,
    QueueFull,
    Sequence,
    ShuttingDown,
    kv_budget,
    kv_bytes_per_token,
    kv_shape,
)
from gpuwise.serve.engine_client import EngineClient
from gpuwise.serve.packed import MKL, ONEDNN, mkl_fits, pack_linears, packing
from gpuwise.workloads.serving import ClientError, Limits, ServeContext, Text

RETRY_AFTER_S = 1  # what a 429 tells the client: the queue moves every decode step (tens of ms)


class GenerateRequest(BaseModel):
    """gpuwise's own route, kept for the clients written against it before the OpenAI API."""

    prompt: Text = Field(min_length=1)
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0, le=5, allow_inf_nan=False, description="0 (or under 0.001): greedy")
    top_p: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    stop: list[Annotated[Text, Field(min_length=1, max_length=p.MAX_STOP_CHARS)]] = Field(
        default_factory=list,
        max_length=p.MAX_STOP,
        description=f"Up to 4 strings of up to {p.MAX_STOP_CHARS} characters",
    )
    stream: bool = Field(False, description='Server-sent events: data: {"text": ...} per piece, then data: [DONE]')


class GenerateResponse(BaseModel):
    text: str
    tokens: int
    finish_reason: str


def chat_prompt(tok, messages: list[p.ChatMessage]) -> str:
    """The model's own chat template with the assistant's turn opened; a plain "role: text" transcript
    for a model that has none (a base model, or gpuwise's scratch model)."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


@dataclass(frozen=True)
class Stream:
    """One submitted request: its sequence, the queue its events arrive on, and the engine running it."""

    seq: Sequence
    queue: asyncio.Queue
    engine: EngineClient


class Backend:
    """One loaded model (a base, with the LoRA adapters that share it), its tokenizer, and its engine."""

    def __init__(self, model, tok, limits: Limits, dtype: str, device: str, stats: EngineStats):
        import torch

        self.tok, self.precision = tok, dtype
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.model = model.to(device, torch_dtype).eval()
        # on a CPU the weights are packed once for oneDNN (bf16, fp32; MKL for fp32 where oneDNN is missing)
        self.pack, self.pack_note = packing(device, torch_dtype), ""
        if self.pack == MKL:
            fits, self.pack_note = mkl_fits(self.model, free_bytes(device))
            self.pack = self.pack if fits else None
        self.decoder, self.forward_note = fused_decoder(self.model, self.pack)
        if self.decoder is not None:
            self.packed, self.packed_bytes = self.decoder.packed()
        else:
            self.packed, self.packed_bytes = pack_linears(self.model, self.pack) if self.pack else (0, 0)
        self.context = limits.context(int(getattr(model.config, "max_position_embeddings", None) or 2048))
        self.kv_bytes_per_token = kv_bytes_per_token(*kv_shape(model.config), torch_dtype)
        # the prefix cache, full, comes out of the same memory as the running sequences' cache
        free = free_bytes(device) - limits.prefix_cache_tokens * self.kv_bytes_per_token
        self.kv_budget = kv_budget(free, self.kv_bytes_per_token, self.context, limits.max_seqs)
        self.engine = Engine(
            self.model,
            tok,
            max_seqs=limits.max_seqs,
            kv_budget_tokens=self.kv_budget,
            max_queue=limits.max_queue,
            context=self.context,
            stats=stats,
            decoder=self.decoder,
            prefix_tokens=limits.prefix_cache_tokens,
        )

    def close(self) -> None:
        self.engine.close()

    def _plan_request(self):
        from gpuwise.plan.request import PlanRequest
        from gpuwise.workloads.pretrained import spec_of

        precision = "bf16" if self.precision == "fp16" else self.precision  # the planner's 2-byte name
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return precision, spec_of(base), PlanRequest(task="inference", batch=1, seq=1, gen=0, precision=precision)

    def planned_kv_bytes_per_token(self) -> float:
        from gpuwise.plan.memory import kv_cache_bytes
        from gpuwise.plan.request import Layout

        _, spec, one = self._plan_request()
        return kv_cache_bytes(spec, one, Layout())

    def plan(self) -> str:
        """What `gpuwise plan` counts for this model here, and so how many sequences the engine admits."""
        from gpuwise.plan.memory import BYTES, kv_cache_bytes, weight_bytes
        from gpuwise.plan.request import Layout

        precision, spec, one = self._plan_request()
        per_token = kv_cache_bytes(spec, one, Layout())
        weights = weight_bytes(spec, one)
        full = self.kv_budget // self.context
        return (
            f"plan ({precision}, gpuwise plan's formulas): weights {weights / 1e9:.2f} GB, KV cache "
            f"{per_token / 1024:.1f} KiB per token ({BYTES[precision]} bytes x 2 x layers x KV heads x head dim); "
            f"budget {self.kv_budget:,} tokens: up to {self.engine.max_seqs} sequences at once, "
            f"{full:,} of them at the full context of {self.context:,}"
            + f"; forward: {self.forward_note}"
            + (
                f"; prefix cache {self.engine.prefixes.tokens:,} prompt tokens "
                f"({self.engine.prefixes.tokens * self.kv_bytes_per_token / 1e6:.0f} MB at most)"
                if self.engine.prefixes
                else ""
            )
            + self._packing()
        )

    def _packing(self) -> str:
        if not self.packed:
            return f"; not packed: {self.pack_note}" if self.pack_note else ""
        held = {ONEDNN: "tied weights held twice", MKL: "packed copies beside the plain weights"}
        extra = f" (+{self.packed_bytes / 1e6:.0f} MB: {held[self.pack or '']})" if self.packed_bytes else ""
        return f"; {self.packed} weight matrices packed for {self.pack}{extra}"


class LLM:
    """Causal LMs behind the OpenAI API. `groups`: (model, tokenizer, [(model id, adapter)]) per loaded
    base; an adapter name picks a LoRA adapter loaded into that (peft) model, None the base itself. The
    adapters of one base share its weights and its running batch: each row of a step runs its own adapter
    (peft's mixed-adapter batches), as vLLM serves LoRA modules."""

    batched = False

    def __init__(self, groups: list, limits: Limits, workload: str = "llm", about: str = "", dtype: str = "auto"):
        """gpuwise's own engine: one `Backend` per (model, tokenizer, names) group."""
        device, dtype = llm_device_dtype(dtype)
        backends = [(Backend(model, tok, limits, dtype, device, EngineStats()), names) for model, tok, names in groups]
        why = "gpuwise's own continuous-batching engine"
        self._setup(backends, limits, workload, about, dtype, device, f"engine: gpuwise ({why})")

    @classmethod
    def over(cls, backends: list, limits: Limits, precision: str, device: str, engine: str, **kw) -> LLM:
        """Over backends built elsewhere (vLLM's: serve/vllm.py): [(backend, [(model id, adapter)])]."""
        llm = cls.__new__(cls)
        llm._setup(backends, limits, kw.get("workload", "llm"), kw.get("about", ""), precision, device, engine)
        return llm

    def _setup(self, backends: list, limits: Limits, workload: str, about: str, dtype: str, device: str, engine: str):
        self.limits, self.workload, self.device, self.precision = limits, workload, device, dtype
        self.engine_line = engine  # which engine serves, and why: the first line of the start-up plan
        self.created = int(time.time())
        self.backends = [b for b, _ in backends]
        self.stats: list[EngineStats] = [b.engine.stats for b in self.backends]
        self.route: dict[str, tuple[Any, str | None]] = {}
        for backend, names in backends:
            for name, adapter in names:
                self.route[name] = (backend, adapter)
        self.names = list(self.route)
        self.model_name = ", ".join(self.names) + (f" ({about})" if about else "")

    @classmethod
    def single(cls, model, tok, name: str, limits: Limits, **kw) -> LLM:
        return cls([(model, tok, [(name, None)])], limits, **kw)

    # the first backend, for the one-model case (the start-up plan, `gpuwise chat`)
    @property
    def engine(self) -> Engine:
        return self.backends[0].engine

    @property
    def tok(self):
        return self.backends[0].tok

    def plan(self) -> str:
        return "\n".join([self.engine_line, *(b.plan() for b in self.backends)])

    def planned_kv_bytes_per_token(self) -> float:
        return self.backends[0].planned_kv_bytes_per_token()

    def __call__(self, items: list, /) -> list:
        raise NotImplementedError("an LLM is not served through the dynamic batcher: its engine batches")

    def close(self) -> None:
        for b in self.backends:
            b.close()

    def health(self) -> str | None:
        """None while every engine can answer; else why not."""
        return next((why for b in self.backends if (why := b.engine.health())), None)

    # --- decode: a request -> token ids ---------------------------------------------------------------
    @staticmethod
    def _ids(backend: Backend, text: str, special: bool) -> list[int]:
        return backend.tok(text, add_special_tokens=special)["input_ids"]

    def _params(
        self, backend: Backend, max_tokens: int | None, prompt_len: int, temperature: float, top_p: float, stop, seed
    ) -> Params:
        context = backend.context
        room = context - prompt_len
        if room < 1:
            raise ClientError(400, f"the prompt holds {prompt_len} tokens; this model's context is {context} tokens")
        if max_tokens is None:
            max_tokens = min(room, self.limits.max_tokens)
        elif max_tokens > self.limits.max_tokens:
            raise ClientError(400, f"max_tokens: at most {self.limits.max_tokens} on this server")
        elif prompt_len + max_tokens > context:
            raise ClientError(
                400,
                f"this model's context is {context} tokens; the prompt ({prompt_len}) plus max_tokens "
                f"({max_tokens}) asks for {prompt_len + max_tokens}",
            )
        return Params(max_tokens, temperature, top_p, list(stop or []), seed)

    def _model(self, name: str) -> tuple[Backend, str | None]:
        if name not in self.route:
            raise ClientError(404, f"model '{name}' not found; this server serves: {', '.join(self.names)}")
        return self.route[name]

    def _check_chars(self, text: str) -> None:
        if len(text) > self.limits.max_prompt_chars:
            raise ClientError(413, f"prompt: {len(text):,} characters; at most {self.limits.max_prompt_chars:,}")

    # --- each request is parsed, templated and tokenized on a worker thread, not on the event loop, where a
    # body of many messages would hold every other client (docs/serving.md). Parsing holds the GIL all the same,
    # so a chat's message count is bounded before it is parsed, and the body's size (--max-body-mb) bounds the
    # rest. ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _parse(kind: type[BaseModel], body: bytes):
        # In JSON text a bare "role" (unescaped quotes) is a key or a whole value, never inside a string: at
        # least one per message. A count over it is a C scan (milliseconds); the parse is the bound after it.
        too_many = f"messages: at most {p.MAX_MESSAGES:,} in one request"
        if kind is p.ChatCompletionRequest and body.count(b'"role"') > p.MAX_MESSAGES:
            raise ClientError(422, too_many)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise ClientError(400, "the body is not UTF-8 text") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # a number of 5,000 digits and '[' * 100,000 included
            raise ClientError(422, f"the body is not valid JSON: {str(e)[:120] or type(e).__name__}") from None
        if isinstance(data, dict) and isinstance(data.get("messages"), list) and len(data["messages"]) > p.MAX_MESSAGES:
            raise ClientError(422, too_many)
        try:
            return kind.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None

    def _chat(self, body: bytes) -> tuple[p.ChatCompletionRequest, tuple[Backend, str | None], list[int], Params]:
        ask = self._parse(p.ChatCompletionRequest, body)
        target = self._model(ask.model)
        backend = target[0]
        chars = sum(len(m.text()) for m in ask.messages)
        if chars > self.limits.max_prompt_chars:  # before the template runs over them
            raise ClientError(413, f"messages: {chars:,} characters; at most {self.limits.max_prompt_chars:,}")
        text = chat_prompt(backend.tok, ask.messages)
        self._check_chars(text)
        ids = self._ids(backend, text, special=False)  # the template wrote the special tokens itself
        params = self._params(backend, ask.limit(), len(ids), ask.temperature, ask.top_p, ask.stops(), ask.seed)
        return ask, target, ids, params

    def _completion(self, body: bytes) -> tuple[p.CompletionRequest, tuple[Backend, str | None], list[int], Params]:
        ask = self._parse(p.CompletionRequest, body)
        target = self._model(ask.model)
        assert isinstance(ask.prompt, str)  # the validator made a list of one into its string
        self._check_chars(ask.prompt)
        ids = self._ids(target[0], ask.prompt, special=True)
        params = self._params(target[0], ask.limit(), len(ids), ask.temperature, ask.top_p, ask.stops(), ask.seed)
        return ask, target, ids, params

    def _generate(self, body: bytes) -> tuple[GenerateRequest, tuple[Backend, str | None], list[int], Params]:
        ask = self._parse(GenerateRequest, body)
        if ask.max_tokens > self.limits.max_tokens:
            raise ClientError(422, f"max_tokens: at most {self.limits.max_tokens}")
        self._check_chars(ask.prompt)
        # gpuwise's own route, from before several models: the first one serves it
        target = (self.backends[0], self.route[self.names[0]][1])
        context = target[0].context
        ids = self._ids(target[0], ask.prompt, special=True)
        if len(ids) + ask.max_tokens > context:
            raise ClientError(
                422,
                f"prompt ({len(ids)} tokens) + max_tokens ({ask.max_tokens}) exceeds the context of {context}",
            )
        temperature = ask.temperature if ask.temperature >= GREEDY_BELOW else 0.0
        return ask, target, ids, Params(ask.max_tokens, temperature, ask.top_p, ask.stop)

    # --- predict: through the engine -------------------------------------------------------------------
    def _submit(self, target: tuple[Any, str | None], ids: list[int], params: Params) -> Stream:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict] = asyncio.Queue()

        def sink(event: dict) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed (server shut down): nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, event)

        backend, adapter = target
        seq = Sequence(ids, params, sink, deadline=time.monotonic() + self.limits.timeout_s, adapter=adapter)
        try:
            backend.engine.submit(seq)
        except QueueFull as e:
            raise ClientError(
                429, f"server busy: {e}; retry in {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except ShuttingDown as e:
            raise ClientError(503, str(e)) from None
        return Stream(seq, queue, backend.engine)

    async def _events(self, stream: Stream, request: Request | None) -> AsyncIterator[dict]:
        """The engine's events for the stream; a client that leaves cancels it (its slot is freed)."""
        watcher = asyncio.create_task(self._watch(request, stream)) if request is not None else None
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if "finish" in event:
                    return
        finally:
            stream.engine.cancel(stream.seq)
            if watcher is not None:
                watcher.cancel()

    @staticmethod
    async def _watch(request: Request, stream: Stream) -> None:
        """Wait for the client to leave: one task per request blocked on the ASGI channel, rather than a
        poll of `is_disconnected()` per stream (32 streams polling every 50 ms were ~640 wake-ups a second
        on the event loop that also writes every token). The body has been read by now, so `receive()`
        returns only `http.disconnect`: when the client goes, or when the response is complete."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.engine.cancel(stream.seq)
        stream.queue.put_nowait({"finish": "cancelled"})  # end the stream now; the engine frees the slot

    async def _whole(self, stream: Stream, request: Request) -> tuple[str, dict]:
        text, end = "", dict[str, Any]()
        async for event in self._events(stream, request):
            text += event.get("text", "")
            end = event if "finish" in event else end
        if not end:
            raise ClientError(499, "client closed the request")
        self._raise_for(end)
        return text, end

    def _raise_for(self, end: dict) -> None:
        if end["finish"] == "timeout":
            raise ClientError(504, f"no answer within the {self.limits.timeout_s:g} s request timeout")
        if end["finish"] == "error":
            raise RuntimeError(f"generation failed: {end.get('error')}")
        if end["finish"] == "cancelled":
            raise ClientError(499, "client closed the request")

    def routes(self, ctx: ServeContext) -> None:
        from gpuwise.serve.llm_api import add_routes

        self._metrics(ctx)
        add_routes(self, ctx)

    def _metrics(self, ctx: ServeContext) -> None:
        """vLLM's serving series, under gpuwise_ names, in the server's registry."""
        from prometheus_client import Counter, Gauge, Histogram

        reg, stats = ctx.registry, self.stats
        latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        ttft = Histogram("gpuwise_time_to_first_token_seconds", "Time to first token", buckets=latency, registry=reg)
        itl = Histogram(
            "gpuwise_inter_token_latency_seconds",
            "Time between two tokens of one stream",
            buckets=latency,
            registry=reg,
        )
        e2e = Histogram(
            "gpuwise_e2e_request_latency_seconds", "Request submitted to last token", buckets=latency, registry=reg
        )
        prompt = Counter("gpuwise_prompt_tokens", "Prompt tokens processed", registry=reg)
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: hits / queries is the share not recomputed
        queries = Counter("gpuwise_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=reg)
        hits = Counter("gpuwise_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=reg)
        generated = Counter("gpuwise_generation_tokens", "Tokens generated", registry=reg)
        Gauge("gpuwise_num_requests_running", "Sequences in the running batch", registry=reg).set_function(
            lambda: sum(s.running for s in stats)
        )
        Gauge("gpuwise_num_requests_waiting", "Requests waiting for a slot", registry=reg).set_function(
            lambda: sum(s.waiting for s in stats)
        )
        Gauge(
            "gpuwise_kv_cache_usage_perc", "Share of the KV budget the running sequences reserve", registry=reg
        ).set_function(lambda: sum(s.kv_tokens for s in stats) / sum(b.kv_budget for b in self.backends))

        def finished(seq: Sequence) -> None:
            e2e.observe(time.perf_counter() - seq.t_submit)
            prompt.inc(len(seq.prompt))
            generated.inc(len(seq.out))

        def prefilled(prompt_tokens: int, reused: int) -> None:
            queries.inc(prompt_tokens)
            hits.inc(reused)

        for s in stats:
            s.on_first_token, s.on_token, s.on_finish, s.on_prefill = ttft.observe, itl.observe, finished, prefilled


def llm_device_dtype(dtype: str) -> tuple[str, str]:
    """(device, dtype) a language model is served on: CUDA where there is one; `auto` is bf16 where the
    hardware computes it, fp32 elsewhere (emulated bf16 is slower; benchmarks/engine_step.py,
    docs/benchmarks.md)."""
    import torch

    from gpuwise.hardware.devices import computes_bf16

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, ("bf16" if computes_bf16(device) else "fp32") if dtype == "auto" else dtype


def free_bytes(device: str) -> int:
    """Memory the KV cache may take: on CUDA what is free now less a tenth; on the CPU half of what the
    system has available (the rest is for activations, the tokenizer and the OS)."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free * 0.9)
    from gpuwise.hardware.cpu import meminfo

    return (meminfo("MemAvailable") or 8 << 30) // 2
