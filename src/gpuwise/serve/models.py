"""What the server runs: a finished run's workload, loaded once as its `Served` object.

Each workload says how it is served (`Workload.serve`: decode -> predict a batch -> encode, and its
routes); `--runtime onnx` swaps a torch forward for onnxruntime's where the workload has an ONNX graph.
"""

from __future__ import annotations

from pathlib import Path

from gpuwise.errors import loading_model
from gpuwise.workloads.serving import CausalLM, Limits, Served


def load_served(run_dir: Path, runtime: str, limits: Limits) -> tuple[Served, object]:
    from gpuwise.train.records import open_finished

    cfg = open_finished(run_dir)
    with loading_model(run_dir):
        served = cfg.workload_def().serve(run_dir, cfg, runtime, limits)
        if isinstance(served, CausalLM):
            from gpuwise.serve.llm import LLM

            served = LLM(served.model, served.tok, served.name, limits, workload=cfg.workload, about=served.description)
        return served, cfg
