"""ONNX export of a finished defects or recommender run, and an onnxruntime forward over the result.

The graph takes what the torch model takes: defects, images already scaled to [-1, 1] as
``defects.to_tensor`` does; recommender, user indices into ids.json's ``users``. Scoring and
thresholds stay in Python on both sides, so torch and ONNX serving share them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gpuwise.errors import GpuwiseError, first_line

ONNX_WORKLOADS = ("defects", "recommender")
# input name, output name, and the saved files the torch model is rebuilt from
SIGNATURES = {
    "defects": ("images", "logits", ("labels.json", "model.safetensors")),
    "recommender": ("users", "scores", ("ids.json", "model.safetensors")),
}
_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


def load_torch(run_dir: Path):
    """(cfg, model in eval mode, meta) of a finished defects/recommender run, or a one-line GpuwiseError."""
    from gpuwise.train.records import load_config, loading_model, require_finished

    cfg = load_config(run_dir)
    if cfg.workload not in ONNX_WORKLOADS:
        raise GpuwiseError(f"export --format onnx covers defects and recommender; {cfg.workload} serves through torch")
    require_finished(run_dir)
    missing = [f for f in SIGNATURES[cfg.workload][2] if not (run_dir / f).exists()]
    if missing:
        raise GpuwiseError(f"{run_dir}: no {', '.join(missing)} — the run saved no model to export")
    with loading_model(run_dir):
        if cfg.workload == "defects":
            from gpuwise.workloads.defects import load_trained

            model, meta = load_trained(run_dir, cfg)
        else:
            from gpuwise.workloads.recommender import load_trained

            model, meta = load_trained(run_dir)
    return cfg, model.eval(), meta


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

    cfg, model, meta = loaded or load_torch(run_dir)
    in_name, out_name, _ = SIGNATURES[cfg.workload]
    if cfg.workload == "defects":
        size = meta["image_size"]
        module, example = model, torch.zeros(2, 1, size, size)
    else:
        from gpuwise.workloads.recommender import AllScores

        module, example = AllScores(model).eval(), torch.zeros(2, dtype=torch.int64)
    # An example batch of 2, not 1: torch.export specializes a size-1 dimension to a constant.
    path, tmp = run_dir / "model.onnx", run_dir / f".model.onnx.{os.getpid()}.tmp"
    try:
        with _quiet(), torch.no_grad():
            # dynamo=True: the torch.export-based exporter, default since 2.9; the TorchScript one is
            # deprecated. It exports both models with a symbolic batch and matches torch to ~1e-6.
            torch.onnx.export(
                module,
                (example,),
                str(tmp),
                input_names=[in_name],
                output_names=[out_name],
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


def onnx_forward(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model's one input (float32 images or int64 users) -> its one output, through onnxruntime."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # its errors come back as exceptions; logging them too would print twice
    try:
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own pybind error types
        run = path.parent
        raise GpuwiseError(
            f"{path}: not a readable ONNX model ({first_line(e)}) — run `gpuwise export {run} --format onnx`"
        ) from None
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    dtype = _DTYPES.get(inp.type, np.float32)

    def forward(x: np.ndarray) -> np.ndarray:
        return session.run([out.name], {inp.name: np.ascontiguousarray(x, dtype=dtype)})[0]

    return forward


def sample_inputs(cfg, meta: dict, n: int = 8) -> tuple[np.ndarray, str]:
    """Up to n real inputs for the exported graph, and where they came from: the run's own images
    (its --data folder or ELPV) or users; random images only when its data is not readable here."""
    if cfg.workload == "recommender":
        users = np.unique(np.linspace(0, len(meta["users"]) - 1, n).astype(np.int64))
        return users, "users of ids.json"
    from gpuwise.workloads import defects

    size, images, source = meta["image_size"], None, None
    try:
        if cfg.data:
            root = Path(cfg.data)
            files = sorted(p for p in root.rglob("*") if p.suffix.lower() in defects.IMAGE_SUFFIXES)
            if files:  # evenly spaced over the sorted list, so both class folders are sampled
                pick = [files[int(i)] for i in np.unique(np.linspace(0, len(files) - 1, n).astype(int))]
                images, source = np.stack([defects.read_image(f, size) for f in pick]), str(root)
        else:
            from elpv_dataset.utils import load_dataset

            all_images = load_dataset()[0]
            images = defects._resize(all_images[np.linspace(0, len(all_images) - 1, n).astype(int)], size)
            source = "ELPV"
    except (GpuwiseError, ImportError, OSError, ValueError):
        images = None
    if images is None:
        images = np.random.default_rng(0).integers(0, 256, (n, size, size), dtype=np.uint8)
        source = "random images (the run's data is not readable here)"
    return defects.to_tensor(images).numpy(), source


def compare_with_torch(run_dir: Path, path: Path, n: int = 8, loaded: tuple | None = None) -> dict:
    """onnxruntime vs torch on n real inputs: the largest absolute difference of their outputs."""
    import torch

    cfg, model, meta = loaded or load_torch(run_dir)
    x, source = sample_inputs(cfg, meta, n)
    with torch.no_grad():
        fn = model if cfg.workload == "defects" else model.all_scores
        expected = fn(torch.from_numpy(x)).float().numpy()
    got = onnx_forward(path)(x)
    return {"max_abs_diff": float(np.abs(got - expected).max()), "inputs": len(x), "inputs_from": source}
