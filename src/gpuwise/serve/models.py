"""What the server runs: a finished run's workload, loaded once as its `Served` object.

Each workload says how it is served (`Workload.serve`: decode -> predict a batch -> encode, and its
routes); `--runtime onnx` swaps a torch forward for onnxruntime's where the workload has an ONNX graph.
"""

from __future__ import annotations

from pathlib import Path

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads.serving import CausalLM, Limits, Served


def load_served(run_dir: Path, runtime: str, limits: Limits, dtype: str = "auto") -> tuple[Served, object]:
    from gpuwise.train.records import open_finished

    cfg = open_finished(run_dir)
    with loading_model(run_dir):
        served = cfg.workload_def().serve(run_dir, cfg, runtime, limits)
        if isinstance(served, CausalLM):
            from gpuwise.serve.llm import LLM

            served = LLM(
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


def model_id(ref: str) -> str:
    """The id clients send in "model": a named base or hub id as given, a file or directory by its name."""
    path = Path(ref).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else (path.name if path.exists() else ref)


def load_model(ref: str, limits: Limits, name: str | None = None, dtype: str = "auto"):
    """A language model that is not a gpuwise run (a named base, a .gguf file, a model directory, a hub
    id) behind the OpenAI API."""
    from gpuwise.serve.llm import LLM
    from gpuwise.workloads.pretrained import resolve_base
    from gpuwise.workloads.product_lm import quiet_transformers

    quiet_transformers()
    path = Path(ref).expanduser()
    if not path.exists() and (ref.startswith((".", "/", "~")) or ref.count("/") > 1):
        raise GpuwiseError(f"{ref}: no such run directory or model file")
    source = resolve_base(ref, flag="serve")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with loading_model(ref):
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source)
    if tok.eos_token_id is None:
        raise GpuwiseError(f"serve {ref}: its tokenizer has no end-of-text token")
    about = source if source != ref else ""
    return LLM(model, tok, name or model_id(ref), limits, workload="llm", about=about, dtype=dtype)
