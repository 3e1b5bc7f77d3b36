"""What the server runs: a finished run's workload, loaded once as its `Served` object, or language models behind
the OpenAI front on the engine `serve.engines.choose` picked (`load`, the one dispatch).

Each workload says how it is served (`Workload.serve`: decode -> predict a batch -> encode, and its
routes); `--runtime onnx` swaps a torch forward for onnxruntime's where the workload has an ONNX graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.hardware.devices import llm_device_dtype
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.model import read_gguf_header
from gpuwise.serve.engines.gpuwise.backend import WHY, gpuwise_backends
from gpuwise.serve.engines.gpuwise.quant import QUANTIZED
from gpuwise.serve.engines.llamacpp import DTYPES, LlamaCppBackend
from gpuwise.serve.engines.vllm import VLLMBackend
from gpuwise.serve.llm.core import LLM
from gpuwise.train.records import is_run, open_finished
from gpuwise.workloads.pretrained import SCRATCH, quiet_transformers, resolve_base
from gpuwise.workloads.serving import CausalLM, Limits, Served

if TYPE_CHECKING:
    from gpuwise.serve.engines.choose import Chosen


@dataclass(frozen=True)
class Target:
    """What `gpuwise serve` was given: a run or model (`ref`) and --model NAME=REF specs; `refs`, the language
    models among them as [(name, ref)] (none for a trained run of another workload)."""

    ref: str | None
    specs: tuple[str, ...]
    refs: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, ref: str | None, specs: list[str] | None) -> Target:
        if ref is None and not specs:
            raise GpuwiseError("give a run or a model to serve (or --model NAME=PATH, repeatable)")
        language = bool(specs) or is_model(str(ref)) or _is_lm_run(Path(str(ref)))
        refs = parse_models(([ref] if ref is not None else []) + list(specs or [])) if language else []
        return cls(ref, tuple(specs or ()), tuple(refs))


def load(
    target: Target, chosen: Chosen, runtime: str, limits: Limits, dtype: str, timeout_s: float, weights: str = "auto"
) -> Served:
    """The served object for `target` on the engine `chosen`: the one place a choice becomes a server."""
    refs = list(target.refs)
    if weights in QUANTIZED and chosen.engine != "gpuwise":
        raise GpuwiseError(
            f"--weights {weights} quantizes for gpuwise's engine (--engine gpuwise); {chosen.engine} serves a "
            "quantized GGUF as it ships (give the .gguf, or --dtype q8_0 on llama.cpp)"
        )
    if refs and runtime != "torch":
        raise GpuwiseError("--runtime onnx applies to image and ranking runs; a language model runs on torch")
    if chosen.engine == "vllm":
        assert chosen.vllm_python is not None
        return load_vllm(refs, limits, dtype, chosen.vllm_python, timeout_s, chosen.why)
    if chosen.engine == "llama.cpp":
        assert chosen.llama_server is not None
        return load_llamacpp(refs, limits, dtype, chosen.llama_server, timeout_s, chosen.why)
    if target.specs:
        return load_models(refs, limits, dtype, chosen.why, weights)
    assert target.ref is not None
    if is_model(target.ref):
        return load_model(target.ref, limits, dtype=dtype, why=chosen.why, weights=weights)
    return load_served(Path(target.ref), runtime, limits, dtype, chosen.why, weights)[0]


def gpuwise_llm(
    groups: list, limits: Limits, dtype: str, why: str, weights: str = "auto", gguf: Path | None = None, **about: str
) -> LLM:
    """(model, tokenizer, [(model id, adapter)]) groups behind the OpenAI front on gpuwise's own engine; `weights`
    (auto: the dtype's) bf16, or int8 / int4 quantized at load (quant.py), or taken as the GGUF file `gguf` ships
    them where it holds them in that format."""
    device, dtype = llm_device_dtype("bf16" if dtype == "auto" and weights == "bf16" else dtype)
    backends = gpuwise_backends(groups, limits, dtype, device, weights, gguf)
    return LLM(backends, limits, dtype, device, f"engine: gpuwise ({why})", **about)


def load_served(
    run_dir: Path, runtime: str, limits: Limits, dtype: str = "auto", why: str = WHY, weights: str = "auto"
) -> tuple[Served, object]:
    cfg = open_finished(run_dir)
    with loading_model(run_dir):
        served = cfg.workload_def().serve(run_dir, cfg, runtime, limits)
        if isinstance(served, CausalLM):
            group = (served.model, served.tok, [(served.name, None)])
            served = gpuwise_llm([group], limits, dtype, why, weights, workload=cfg.workload, about=served.description)
        return served, cfg


def _is_lm_run(path: Path) -> bool:
    """Whether a finished run is a language model's (served behind the OpenAI API, on any engine)."""
    return open_finished(path).workload_def().inputs == "prompts"


def is_model(ref: str) -> bool:
    """Whether `gpuwise serve REF` names a model rather than a run: a named base, a .gguf file, a directory
    with config.json and no config.yaml, or what can only be a hub id. Anything else is read as a run, so a
    damaged run gets the run's errors."""
    path = Path(ref).expanduser()
    if ref in NAMED_BASES or path.suffix.lower() == ".gguf":
        return True
    if path.exists():
        return path.is_dir() and (path / "config.json").is_file() and not is_run(path)
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise GpuwiseError(f"{ref}: no such run directory or model file")
    return True  # a hub id


def model_id(ref: str) -> str:
    """The id clients send in "model": a named base or hub id as given, a file or directory by its name."""
    path = Path(ref).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else (path.name if path.exists() else ref)


def check_gguf(ref: str) -> None:
    """A .gguf file's header read by gpuwise's own bounded reader (plan/model.py) before transformers is given the
    file: a damaged or hostile header (arrays nested 1,000 deep, a string of 2^63 bytes, a count past the file's
    end) is one line here. transformers reads GGUF through the gguf package's GGUFReader, which memory-maps the
    whole file and parses the header without such bounds.

    What this cannot cover: the file is read again, memory-mapped, once the header has passed (the conversion to
    safetensors, cached by the file's digest, so once per file), and a file truncated by another process during
    that read ends the process with SIGBUS. Converting from a private copy would close it at the cost of copying
    gigabytes, and the race needs another process that can write the file, so it is left open."""
    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf" and path.exists():
        read_gguf_header(path)


def load_model(
    ref: str, limits: Limits, name: str | None = None, dtype: str = "auto", why: str = WHY, weights: str = "auto"
) -> LLM:
    """A language model that is not a gpuwise run (a named base, a .gguf file, a model directory, a hub
    id) behind the OpenAI API, on gpuwise's engine."""
    check_gguf(ref)
    quiet_transformers()
    source = resolve_base(ref, flag="serve")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with loading_model(ref):
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source)
    if tok.eos_token_id is None:
        raise GpuwiseError(f"serve {ref}: its tokenizer has no end-of-text token")
    about = source if source != ref else ""
    shipped = shipped_gguf(ref) if weights in QUANTIZED else None
    group = (model, tok, [(name or model_id(ref), None)])
    return gpuwise_llm([group], limits, dtype, why, weights, shipped, about=about)


def shipped_gguf(ref: str) -> Path | None:
    """The GGUF file `ref` names (a named base, a .gguf path), whose quantized blocks `--weights` may take as they
    ship; None for anything else."""
    if ref in NAMED_BASES:
        return Path(named_base_path(ref))
    path = Path(ref).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def model_groups(
    specs: list[tuple[str, str]], given: dict[str, str] | None = None
) -> dict[str, list[tuple[str, Path | None]]]:
    """`--model NAME=REF` specs -> {the base's source: [(name, its LoRA adapter or None)]}. A language-model
    LoRA run is its adapter over its base: runs over the same base share one copy of it. `given`, where passed,
    gets {source: the first REF that named it} for the models given directly (a named base, a .gguf file)."""
    quiet_transformers()
    groups: dict[str, list[tuple[str, Path | None]]] = {}
    for name, ref in specs:
        path = Path(ref).expanduser()
        if is_run(path):
            cfg = open_finished(path)
            if cfg.workload_def().inputs != "prompts":
                raise GpuwiseError(f"--model {name}={ref}: a {cfg.workload} run is not a language model")
            if cfg.method == "full":
                source, adapter = str((path / "model").resolve()), None
            else:
                base = path / "base" if cfg.base in (None, SCRATCH) else Path(resolve_base(cfg.base, flag="--model"))
                source, adapter = str(base.resolve()) if base.exists() else str(base), path / "adapter"
        else:
            if not path.exists() and (ref.startswith((".", "/", "~")) or ref.count("/") > 1):
                raise GpuwiseError(f"--model {name}={ref}: no such run directory or model file")
            check_gguf(ref)
            found = resolve_base(ref, flag="--model")
            source, adapter = (str(Path(found).resolve()) if Path(found).exists() else found), None
            if given is not None:
                given.setdefault(source, ref)
        groups.setdefault(source, []).append((name, adapter))
    return groups


def load_models(
    specs: list[tuple[str, str]], limits: Limits, dtype: str = "auto", why: str = WHY, weights: str = "auto"
) -> LLM:
    """Several language models in one server (`--model NAME=REF`, repeatable) on gpuwise's engine: LoRA runs
    over the same base share one copy of it and one running batch, and a base named too is served from that
    same copy."""
    groups = model_groups(specs)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    built = []
    for source, entries in groups.items():
        with loading_model(source, "--model"):
            tok = AutoTokenizer.from_pretrained(source)
            model: Any = AutoModelForCausalLM.from_pretrained(source)
            adapters = [(n, a) for n, a in entries if a is not None]
            if adapters:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapters[0][1]), adapter_name=adapters[0][0])
                for n, a in adapters[1:]:
                    model.load_adapter(str(a), adapter_name=n)
        if tok.eos_token_id is None:
            raise GpuwiseError(f"--model {source}: its tokenizer has no end-of-text token")
        built.append((model, tok, [(n, n if a is not None else None) for n, a in entries]))
    return gpuwise_llm(built, limits, dtype, why, weights)


def load_vllm(specs: list[tuple[str, str]], limits: Limits, dtype: str, python: str, timeout_s: float, why: str):
    """The same models served by vLLM (serve/engines/vllm.py): one vLLM server per base, its LoRA runs as vLLM's LoRA
    modules. gpuwise loads only the tokenizer and the config: the weights are vLLM's to hold."""
    device, dtype = llm_device_dtype(dtype)
    backends = vllm_backends(specs, limits, dtype, device, python, timeout_s)
    return LLM(backends, limits, dtype, device, f"engine: vllm ({why})")


def vllm_backends(specs: list[tuple[str, str]], limits: Limits, dtype: str, device: str, python: str, timeout_s: float):
    """[(VLLMBackend, [(model id, adapter)])]: one started vLLM server per base."""
    def make(ref, source, tok, config, entries):
        return VLLMBackend(source, tok, config, entries, limits, dtype, device).start(python, timeout_s)

    return engine_backends(specs, make)


def load_llamacpp(specs: list[tuple[str, str]], limits: Limits, dtype: str, binary: Path, timeout_s: float, why: str):
    """The same models served by llama.cpp (serve/engines/llamacpp.py): one llama-server per base, a GGUF as it ships
    (or converted once), its LoRA runs as GGUF adapters applied per request."""
    backends = llamacpp_backends(specs, limits, dtype, binary, timeout_s)
    return LLM(backends, limits, backends[0][0].precision, "cpu", f"engine: llama.cpp ({why})")


def llamacpp_backends(specs: list[tuple[str, str]], limits: Limits, dtype: str, binary: Path, timeout_s: float):
    """[(LlamaCppBackend, [(model id, adapter)])]: one started llama-server per base."""
    if dtype not in DTYPES:
        raise GpuwiseError(f"--dtype {dtype}: llama.cpp serves {', '.join(DTYPES)}")

    def make(ref, source, tok, config, entries):
        return LlamaCppBackend(ref, source, tok, config, entries, limits, dtype, binary).start(timeout_s)

    return engine_backends(specs, make)


def engine_backends(specs: list[tuple[str, str]], make) -> list:
    """[(backend, [(model id, adapter)])] for an engine gpuwise starts (vLLM, llama.cpp): one per base, made and
    started by `make(ref, source, tokenizer, config, [(name, adapter)])`, where `ref` is the model as given (a
    named base or a .gguf file, which llama.cpp serves as it ships) or the base's directory. gpuwise loads only
    the tokenizer and the config: the weights are the engine's to hold. A base that fails stops those started."""
    given: dict[str, str] = {}
    groups = model_groups(specs, given)
    from transformers import AutoConfig, AutoTokenizer

    backends: list = []
    try:
        for source, entries in groups.items():
            with loading_model(source, "--model"):
                tok = AutoTokenizer.from_pretrained(source)
                config = AutoConfig.from_pretrained(source)
            if tok.eos_token_id is None:
                raise GpuwiseError(f"--model {source}: its tokenizer has no end-of-text token")
            backend = make(given.get(source, source), source, tok, config, entries)
            backends.append((backend, [(n, n if a is not None else None) for n, a in entries]))
    except BaseException:  # a later base failed: the servers already started stop with it
        for backend, _ in backends:
            backend.close()
        raise
    return backends


def parse_models(values: list[str]) -> list[tuple[str, str]]:
    """--model NAME=REF (or a bare REF, named after its file or directory) -> [(name, ref)], names unique."""
    out: list[tuple[str, str]] = []
    for value in values:
        name, sep, ref = value.partition("=")
        name, ref = (name.strip(), ref.strip()) if sep else (model_id(value), value)
        if not name or not ref or any(c.isspace() for c in name):
            raise GpuwiseError(f"--model {value}: give NAME=PATH, a name without spaces")
        if name in {n for n, _ in out}:
            raise GpuwiseError(f"--model {value}: the name {name!r} is given twice")
        out.append((name, ref))
    return out
