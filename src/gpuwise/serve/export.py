"""ONNX export of a finished run whose workload has an ONNX graph (`Workload.onnx`), and a check of the
result against torch on real inputs.

The graph takes what the torch model takes (`Workload.export_model`): images already scaled as the
model wants them, or ids. Scoring and thresholds stay in Python on both sides, so torch and ONNX serving
share them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from gpuwise.errors import GpuwiseError, first_line, loading_model
from gpuwise.train.records import load_config, require_finished
from gpuwise.workloads.serving import onnx_forward

__all__ = ["compare_with_torch", "export_onnx", "load_torch", "onnx_forward"]


def load_torch(run_dir: Path):
    """(cfg, workload, module to export in eval mode, example input, meta) of a finished run, or one line."""
    cfg = load_config(run_dir)
    workload = cfg.workload_def()
    if workload.onnx is None:
        raise GpuwiseError(f"export --format onnx does not apply to {cfg.workload}: it serves through torch")
    require_finished(run_dir)
    missing = [f for f in workload.onnx.files if not (run_dir / f).exists()]
    if missing:
        raise GpuwiseError(f"{run_dir}: no {', '.join(missing)} — the run saved no model to export")
    with loading_model(run_dir):
        module, example, meta = workload.export_model(run_dir, cfg)
    return cfg, workload, module.eval(), example, meta


@contextlib.contextmanager
def _quiet():
    """The exporter logs, warns (deprecations, missing torchvision ops) and prints progress; the CLI
    prints its own one-line result instead."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_onnx(run_dir: Path, loaded: tuple | None = None) -> Path:
    """Write RUN/model.onnx (batch dimension dynamic), check it, and return its path."""
    import onnx
    import torch

    _, workload, module, example, _ = loaded or load_torch(run_dir)
    # An example batch of 2, not 1: torch.export specializes a size-1 dimension to a constant.
    # The temp is made new under a random name (mkstemp: O_EXCL), so the exporter writes to a file of ours,
    # never through a link planted under a name it could guess.
    fd, name = tempfile.mkstemp(prefix=".model.onnx.", suffix=".tmp", dir=run_dir)
    os.close(fd)
    path, tmp = run_dir / "model.onnx", Path(name)
    try:
        with _quiet(), torch.no_grad():
            # dynamo=True: the torch.export-based exporter, default since 2.9; the TorchScript one is
            # deprecated. It exports both models with a symbolic batch and matches torch to ~1e-6.
            torch.onnx.export(
                module,
                (example,),
                str(tmp),
                input_names=[workload.onnx.input],
                output_names=[workload.onnx.output],
                dynamic_shapes=({0: torch.export.Dim("batch")},),
                dynamo=True,
                external_data=False,  # one self-contained file, so the rename below moves all of it
                verbose=False,
            )
        onnx.checker.check_model(str(tmp))
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - the exporter and checker raise many types
        raise GpuwiseError(f"{run_dir}: ONNX export failed ({first_line(e)})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def compare_with_torch(run_dir: Path, path: Path, n: int = 8, loaded: tuple | None = None) -> dict:
    """onnxruntime vs torch on n real inputs: the largest absolute difference of their outputs."""
    import torch

    cfg, workload, module, _, meta = loaded or load_torch(run_dir)
    x, source = workload.export_inputs(cfg, meta, n)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).float().numpy()
    got = onnx_forward(path)(x)
    return {"max_abs_diff": float(np.abs(got - expected).max()), "inputs": len(x), "inputs_from": source}
