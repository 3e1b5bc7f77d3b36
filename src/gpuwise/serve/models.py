"""What the server runs: a finished run's workload, loaded once as its `Served` object.

Each workload says how it is served (`Workload.serve`: decode -> predict a batch -> encode, and its
routes); `--runtime onnx` swaps a torch forward for onnxruntime's where the workload has an ONNX graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads.serving import CausalLM, Limits, Served


def load_served(run_dir: Path, runtime: str, limits: Limits, dtype: str = "auto") -> tuple[Served, object]:
    from gpuwise.train.records import open_finished

    cfg = open_finished(run_dir)
    with loading_model(run_dir):
        served = cfg.workload_def().serve(run_dir, cfg, runtime, limits)
        if isinstance(served, CausalLM):
            from gpuwise.serve.llm import LLM

            served = LLM.single(
                served.model,
                served.tok,
                served.name,
                limits,
                workload=cfg.workload,
                about=served.description,
                dtype=dtype,
            )
        return served, cfg


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def is_model(ref: str) -> bool:
    """Whether `gpuwise serve REF` names a model rather than a run: a named base, a .gguf file, a directory
    with config.json and no config.yaml, or what can only be a hub id. Anything else is read as a run, so a
    damaged run gets the run's errors."""
    from gpuwise.plan.bases import NAMED_BASES

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
    from gpuwise.plan.model import read_gguf_header

    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf" and path.exists():
        read_gguf_header(path)


def load_model(ref: str, limits: Limits, name: str | None = None, dtype: str = "auto"):
    """A language model that is not a gpuwise run (a named base, a .gguf file, a model directory, a hub
    id) behind the OpenAI API."""
    from gpuwise.serve.llm import LLM
    from gpuwise.workloads.pretrained import quiet_transformers, resolve_base

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
    return LLM.single(model, tok, name or model_id(ref), limits, workload="llm", about=about, dtype=dtype)


def model_groups(
    specs: list[tuple[str, str]], given: dict[str, str] | None = None
) -> dict[str, list[tuple[str, Path | None]]]:
    """`--model NAME=REF` specs -> {the base's source: [(name, its LoRA adapter or None)]}. A language-model
    LoRA run is its adapter over its base: runs over the same base share one copy of it. `given`, where passed,
    gets {source: the first REF that named it} for the models given directly (a named base, a .gguf file)."""
    from gpuwise.train.records import open_finished
    from gpuwise.workloads.pretrained import SCRATCH, quiet_transformers, resolve_base

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


def load_models(specs: list[tuple[str, str]], limits: Limits, dtype: str = "auto"):
    """Several language models in one server (`--model NAME=REF`, repeatable) on gpuwise's engine: LoRA runs
    over the same base share one copy of it and one running batch, and a base named too is served from that
    same copy."""
    from gpuwise.serve.llm import LLM

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
    return LLM(built, limits, dtype=dtype)


def load_vllm(specs: list[tuple[str, str]], limits: Limits, dtype: str, python: str, timeout_s: float, why: str):
    """The same models served by vLLM (serve/vllm.py): one vLLM server per base, its LoRA runs as vLLM's LoRA
    modules. gpuwise loads only the tokenizer and the config: the weights are vLLM's to hold."""
    from gpuwise.serve.llm import LLM, llm_device_dtype

    device, dtype = llm_device_dtype(dtype)
    backends = vllm_backends(specs, limits, dtype, device, python, timeout_s)
    return LLM.over(backends, limits, dtype, device, f"engine: vllm ({why})")


def vllm_backends(specs: list[tuple[str, str]], limits: Limits, dtype: str, device: str, python: str, timeout_s: float):
    """[(VLLMBackend, [(model id, adapter)])]: one started vLLM server per base."""
    from gpuwise.serve.vllm import VLLMBackend

    def make(ref, source, tok, config, entries):
        return VLLMBackend(source, tok, config, entries, limits, dtype, device).start(python, timeout_s)

    return engine_backends(specs, make)


def load_llamacpp(specs: list[tuple[str, str]], limits: Limits, dtype: str, binary: Path, timeout_s: float, why: str):
    """The same models served by llama.cpp (serve/llamacpp.py): one llama-server per base, a GGUF as it ships
    (or converted once), its LoRA runs as GGUF adapters applied per request."""
    from gpuwise.serve.llm import LLM

    backends = llamacpp_backends(specs, limits, dtype, binary, timeout_s)
    precision = backends[0][0].precision
    return LLM.over(backends, limits, precision, "cpu", f"engine: llama.cpp ({why})")


def llamacpp_backends(specs: list[tuple[str, str]], limits: Limits, dtype: str, binary: Path, timeout_s: float):
    """[(LlamaCppBackend, [(model id, adapter)])]: one started llama-server per base."""
    from gpuwise.serve.llamacpp import DTYPES, LlamaCppBackend

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
