"""Which engine serves a language model: the one place `gpuwise serve --engine` is decided, from the device, the
model's format, the adapters and the streams expected (the rule: plan/engines.py `auto_engine`), and from what is
installed here. The CLI asks `choose_engine` and prints its answer; `serve.models.load` starts what it chose."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.devices import serving_device
from gpuwise.plan.engines import ENGINES, auto_engine, quantized_gguf
from gpuwise.serve.engines.gpuwise import attention
from gpuwise.serve.engines.llamacpp import DTYPES as LLAMA_CPP_DTYPES
from gpuwise.serve.engines.llamacpp import find_llama_server, llama_server_version
from gpuwise.serve.engines.vllm import find_vllm
from gpuwise.train.records import is_run, open_finished

DTYPES = ("auto", "fp32", "bf16", "fp16", "q8_0")  # --dtype: q8_0 is llama.cpp's alone


@dataclass(frozen=True)
class Chosen:
    """The engine that serves, why (the start-up plan's first line), and where its program is: vLLM's Python,
    or llama-server."""

    engine: str
    why: str
    vllm_python: str | None = None
    llama_server: Path | None = None
    weights: str | None = None  # `auto` on a quantized GGUF: the --weights that holds the file's own blocks


def choose_engine(
    engine: str,
    refs: list[tuple[str, str]],
    streams: int,
    dtype: str,
    vllm_python: str | None = None,
    llama_server: str | None = None,
) -> Chosen:
    """`--engine` for the language models `refs` ([(name, ref)]; none: a trained run that is not a language
    model, which gpuwise's server runs) at `streams` (--max-seqs) and `dtype`: the rule of
    `plan.engines.auto_engine`. An engine asked for by name that is not installed is one line, never another
    engine in its place; so is a --dtype the chosen engine does not serve."""
    if engine not in ENGINES:
        raise GpuwiseError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise GpuwiseError(f"--dtype {dtype}: choose auto, fp32, bf16, fp16 or q8_0 (llama.cpp)")
    chosen = _choose(engine, refs, streams, dtype, vllm_python, llama_server)
    if chosen.engine == "gpuwise" and chosen.weights is None and dtype == "auto" and len(refs) == 1:
        # --engine gpuwise on a quantized GGUF: its weights as `auto` measures them between gpuwise's two ways
        gguf = quantized_gguf(refs[0][1])
        if gguf is not None and serving_device() == "cpu":
            held = auto_engine("cpu", False, False, gguf, streams, no_kernels=attention.unavailable(),
                               isa=attention.isa()).weights  # fmt: skip
            chosen = replace(chosen, weights=held)
    if dtype not in (LLAMA_CPP_DTYPES if chosen.engine == "llama.cpp" else DTYPES[:4]):
        raise GpuwiseError(
            f"--dtype {dtype} is llama.cpp's (--engine llama.cpp); {chosen.engine} serves fp32, bf16, fp16"
        )
    return chosen


def _choose(
    engine: str,
    refs: list[tuple[str, str]],
    streams: int,
    dtype: str,
    vllm_python: str | None,
    llama_server: str | None,
) -> Chosen:
    if not refs:
        if engine in ("vllm", "llama.cpp"):
            raise GpuwiseError(f"--engine {engine} serves language models; this run's workload is not one")
        return Chosen("gpuwise", "a trained run: gpuwise's own server")
    if engine == "gpuwise":
        return Chosen("gpuwise", "--engine gpuwise")
    device = serving_device()
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
        choice = auto_engine(device, found is not None)
        if choice.engine == "vllm":
            assert found is not None
            return Chosen("vllm", f"{choice.why}; {found[1]}", vllm_python=found[0])
        return Chosen(choice.engine, choice.why)
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
    gguf = quantized_gguf(refs[0][1]) if dtype == "auto" and len(refs) == 1 else None
    no_kernels = attention.unavailable() if device == "cpu" else ""
    choice = auto_engine(device, False, server is not None, gguf, streams, adapters, no_kernels, attention.isa())
    if choice.engine == "llama.cpp":
        assert server is not None
        llama_server_version(server[0])  # a build for another CPU is one line here, not a crash mid-request
        why = f"{choice.why}; llama-server at {server[0]} ({server[1]})"
        return Chosen("llama.cpp", why, llama_server=server[0])
    return Chosen(choice.engine, choice.why, weights=choice.weights)


def _is_lora_run(ref: str) -> bool:
    path = Path(ref).expanduser()
    if not is_run(path):
        return False
    try:
        return open_finished(path).method != "full"
    except GpuwiseError:
        return False  # a damaged run: its own error comes when it is loaded
