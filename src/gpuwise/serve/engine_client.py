"""The engine interface the OpenAI server (serve/llm.py, serve/llm_api.py) is written over. Two engines
implement it: gpuwise's own continuous-batching `Engine` (serve/engine.py) and `VLLMEngine` (serve/vllm.py),
a vLLM server gpuwise supervises. The routes, limits, key, Host checks and metrics are the same over both."""

from __future__ import annotations

from typing import Protocol

from gpuwise.serve.engine import EngineStats, QueueFull, Sequence, ShuttingDown

__all__ = ["EngineClient", "QueueFull", "ShuttingDown"]


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
