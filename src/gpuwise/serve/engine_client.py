"""The engine interface the OpenAI server (serve/llm.py, serve/llm_api.py) is written over, and which engine
`--engine` picks. Three engines implement it: gpuwise's own continuous-batching `Engine` (serve/engine.py),
`VLLMEngine` (serve/vllm.py) and `LlamaCppEngine` (serve/llamacpp.py), the last two servers gpuwise starts
and supervises (serve/child.py). The routes, limits, key, Host checks and metrics are the same over all."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuwise.errors import GpuwiseError
from gpuwise.serve.engine import EngineStats, QueueFull, Sequence, ShuttingDown

__all__ = ["Chosen", "EngineClient", "QueueFull", "ShuttingDown", "choose_engine"]


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


@dataclass(frozen=True)
class Chosen:
    """The engine that serves, why (the start-up plan's first line), and where its program is: vLLM's Python,
    or llama-server."""

    engine: str
    why: str
    vllm_python: str | None = None
    llama_server: Path | None = None


def choose_engine(
    engine: str,
    refs: list[tuple[str, str]],
    streams: int,
    dtype: str,
    vllm_python: str | None = None,
    llama_server: str | None = None,
) -> Chosen:
    """`--engine` for the models `refs` ([(name, ref)]) at `streams` (--max-seqs): the rule of
    `plan.engines.auto_engine`. An engine asked for by name that is not installed is one line, never another
    engine in its place."""
    import torch

    from gpuwise.plan.engines import ENGINES, auto_engine
    from gpuwise.serve.llamacpp import find_llama_server, llama_server_version, quantized_gguf
    from gpuwise.serve.vllm import find_vllm

    if engine not in ENGINES:
        raise GpuwiseError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    if engine == "gpuwise":
        return Chosen("gpuwise", "--engine gpuwise")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if engine == "vllm" or (engine == "auto" and device == "cuda"):
        found = find_vllm(vllm_python)
        if engine == "vllm":
            if found is None:
                raise GpuwiseError(
                    "--engine vllm: vLLM is not installed here: this environment has no vllm module, and neither "
                    "--vllm-python nor GPUWISE_VLLM_PYTHON names a Python that has one (docs/serving.md: "
                    "'Install vLLM')"
                )
            return Chosen("vllm", f"--engine vllm; {found[1]}", vllm_python=found[0])
        chosen, why = auto_engine(device, found is not None)
        if chosen == "vllm":
            assert found is not None
            return Chosen("vllm", f"{why}; {found[1]}", vllm_python=found[0])
        return Chosen(chosen, why)
    server = find_llama_server(llama_server)
    if engine == "llama.cpp":
        if device == "cuda":
            raise GpuwiseError("--engine llama.cpp: gpuwise runs llama.cpp on CPUs; on CUDA use vllm or gpuwise")
        if server is None:
            raise GpuwiseError(
                "--engine llama.cpp: llama-server is not installed here: run `make llama.cpp`, or name a build "
                "with --llama-server or GPUWISE_LLAMA_SERVER (docs/serving.md: 'Install llama.cpp')"
            )
        why = f"--engine llama.cpp; llama-server ({llama_server_version(server[0])}) at {server[0]} ({server[1]})"
        return Chosen("llama.cpp", why, llama_server=server[0])
    adapters = any(_is_lora_run(ref) for _, ref in refs)
    quantized = dtype == "auto" and len(refs) == 1 and quantized_gguf(refs[0][1])
    chosen, why = auto_engine(device, False, server is not None, quantized, streams, adapters)
    if chosen == "llama.cpp":
        assert server is not None
        llama_server_version(server[0])  # a build for another CPU is one line here, not a crash mid-request
        return Chosen("llama.cpp", f"{why}; llama-server at {server[0]} ({server[1]})", llama_server=server[0])
    return Chosen(chosen, why)


def _is_lora_run(ref: str) -> bool:
    from gpuwise.serve.models import is_run
    from gpuwise.train.records import open_finished

    path = Path(ref).expanduser()
    if not is_run(path):
        return False
    try:
        return open_finished(path).method != "full"
    except GpuwiseError:
        return False  # a damaged run: its own error comes when it is loaded
