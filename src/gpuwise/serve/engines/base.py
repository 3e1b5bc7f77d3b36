"""What every engine behind gpuwise's OpenAI API shares: the request as an engine sees it (`Sequence`, its
sampling `Params`), the figures /metrics reads (`EngineStats`), the two refusals (`QueueFull`, `ShuttingDown`),
and the two interfaces an engine implements.

- `EngineClient`: one engine's running batch. `submit` a sequence, `cancel` it, `health`, `close`. Its events go
  to the sequence's `sink`.
- `Backend`: one loaded base (with the LoRA adapters that share it) behind one engine: its tokenizer, its serving
  plan (plan/serving.py: context, KV bytes per token, KV budget, slots), the engine, and the plan line it prints.

Three engines implement them: gpuwise's own (`engines/gpuwise/`: `Engine`, `GpuwiseBackend`), vLLM
(`engines/vllm.py`) and llama.cpp (`engines/llamacpp.py`), the last two servers gpuwise starts and supervises
(`engines/child.py`). The OpenAI front (`serve/llm/`) is written over these interfaces alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpuwise.plan.serving import ServingPlan

# A temperature below this samples as greedy: logits / temperature would overflow to inf, sampling to nan.
GREEDY_BELOW = 1e-3


class QueueFull(Exception):
    """The waiting queue is at its bound: the client should come back later (a 429)."""


class ShuttingDown(Exception):
    """The engine has stopped taking requests (a 503)."""


@dataclass
class Params:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens tokens whatever they are (benchmarks: lengths they set)


Sink = Callable[[dict], None]  # called from the engine's thread or task with {"text": ...} or {"finish": ...}


class Sequence:
    """One request in an engine: its prompt, what it generated, and how to reach its client."""

    def __init__(self, prompt: list[int], params: Params, sink: Sink, deadline: float, adapter: str | None = None):
        self.prompt, self.params, self.sink, self.deadline, self.adapter = prompt, params, sink, deadline, adapter
        self.out: list[int] = []
        self.done = 0  # prompt tokens whose keys and values are in the KV cache (prefilling until all are)
        self.reused = 0  # of those, found in the prefix cache
        self.blocks: list[int] = []  # gpuwise's engine: the blocks of its paged KV cache, in position order
        self.sent = ""  # text handed to the client so far
        self.finish: str | None = None
        self.cancelled = threading.Event()
        self.generator: Any = None  # gpuwise's engine: the seeded sampler of a request that gave a seed
        self.detok: Any = None  # gpuwise's engine: its output's text as it grows (detokenize.IncrementalText)
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None  # when its first token came out
        self.t_last: float | None = None

    @property
    def tpot(self) -> float | None:
        """Its time per output token after the first (vLLM's benchmark's TPOT), or None below two tokens."""
        if self.t_first is None or self.t_last is None or len(self.out) < 2:
            return None
        return (self.t_last - self.t_first) / (len(self.out) - 1)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def reserved(self) -> int:
        """KV positions this sequence may come to hold: what admission counts against the budget."""
        return len(self.prompt) + self.params.max_tokens

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class EngineStats:
    """What the server's /metrics reads; the engine writes them."""

    running: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # reserved by the running sequences
    kv_held: int = 0  # positions the KV blocks held have room for (gpuwise's paged cache, its prefix cache's too)
    on_first_token: Callable[[float], None] = lambda s: None
    on_token: Callable[[float], None] = lambda s: None
    on_finish: Callable[[Sequence], None] = lambda s: None
    on_prefill: Callable[[int, int], None] = lambda prompt_tokens, reused: None


class EngineClient(Protocol):
    stats: EngineStats
    max_seqs: int

    def submit(self, seq: Sequence) -> None:
        """Start generating for `seq` (its prompt ids, `Params`, adapter and deadline). Its events go to
        `seq.sink`: {"text": piece} as the text grows, then one {"finish": stop|length|timeout|cancelled|error,
        "prompt_tokens", "completion_tokens"[, "error"]}. Raises QueueFull past the queue's bound and
        ShuttingDown once closed."""
        ...

    def cancel(self, seq: Sequence) -> None:
        """The client has gone: stop generating for `seq` and free its slot."""
        ...

    def health(self) -> str | None:
        """None while the engine can answer; else why not, in one line."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    """One base (with its LoRA adapters) behind one engine: what the OpenAI front needs of it."""

    tok: Any  # the tokenizer: gpuwise templates and tokenizes for every engine
    precision: str  # the weights' precision as served (fp32, bf16, fp16; a GGUF's type on llama.cpp)
    serving: ServingPlan  # context, KV bytes per token, KV budget, slots: plan/serving.py's one plan
    engine: EngineClient

    @property
    def context(self) -> int: ...

    def plan(self) -> str:
        """The start-up plan's lines for this base: its figures, and the engine's knobs set from them."""
        ...

    def close(self) -> None: ...
