"""What a run leaves behind: config.yaml, metrics.jsonl, TensorBoard events, summary.json.

Only rank 0 writes. Writes of whole files go through a temp name and a rename, so a killed run
never leaves half a summary.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from gpuwise.errors import GpuwiseError
from gpuwise.train.config import TrainConfig


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def new_run_dir(cfg: TrainConfig) -> Path:
    if cfg.run_dir:
        path = Path(cfg.run_dir)
        if (path / "config.yaml").exists():
            raise GpuwiseError(
                f"{path} already holds a run: continue it with `gpuwise train --resume {path}` "
                "or pass another --run-dir"
            )
        return path
    return Path("runs") / f"{cfg.workload}-{time.strftime('%Y%m%d-%H%M%S')}"


def load_config(run_dir: Path) -> TrainConfig:
    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise GpuwiseError(f"{run_dir} is not a gpuwise run directory (no config.yaml)") from None
    except (OSError, yaml.YAMLError) as e:
        raise GpuwiseError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise GpuwiseError(f"{path} does not hold a config mapping")
    return TrainConfig.from_dict(data)


class Recorder:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self._metrics = None
        self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def save_config(self, cfg: TrainConfig) -> None:
        if self.enabled:
            write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(cfg.as_dict(), sort_keys=False))

    def log(self, step: int, **values) -> None:
        """Every value to metrics.jsonl; to TensorBoard the loss and evaluations at every step, the rest
        every 10th (each scalar costs ~60 us of protobuf, which a small model's step would feel)."""
        if not self.enabled:
            return
        self._metrics.write(json.dumps({"step": step, **values}) + "\n")
        self._metrics.flush()
        for key, value in values.items():
            if isinstance(value, int | float) and (key == "loss" or key.startswith("eval/") or step % 10 == 0):
                self._tb.add_scalar(key, value, step)

    def summary(self, data: dict) -> None:
        if self.enabled:
            write_atomic(self.run_dir / "summary.json", json.dumps(data, indent=2, default=str) + "\n")

    def close(self) -> None:
        if self.enabled:
            self._metrics.close()
            self._tb.close()
