"""`gpuwise export`: a finished run's model as ONNX, checked against torch on real inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli.options import JsonOpt, WorkloadOpt, console, emit
from gpuwise.errors import GpuwiseError

EPILOG = "Example: gpuwise export runs/WORKLOAD-20261130-101500 --format onnx"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run of a workload with an ONNX graph.")],
    fmt: Annotated[str, typer.Option("--format", help="onnx (the only one): writes RUN_DIR/model.onnx.")] = "onnx",
    confirmed: WorkloadOpt = None,
    as_json: JsonOpt = False,
):
    """Write the trained model as ONNX (dynamic batch), then run onnxruntime and torch on the same
    real inputs and report their largest difference. Language models serve through torch."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.serve.export import compare_with_torch, export_onnx, load_torch

    if fmt != "onnx":
        raise GpuwiseError(f"--format {fmt}: only onnx is supported")
    loaded = load_torch(run_dir)  # once, for the export and the check
    path = export_onnx(run_dir, loaded)
    check = compare_with_torch(run_dir, path, loaded=loaded)
    result = {"path": str(path), "bytes": path.stat().st_size, **check}
    if as_json:
        emit(result)
        return
    console.print(
        f"wrote {path} ({_size(result['bytes'])}); onnxruntime vs torch on {check['inputs']} inputs "
        f"({check['inputs_from']}): max |diff| {check['max_abs_diff']:.1e}",
        markup=False,
        soft_wrap=True,
    )
