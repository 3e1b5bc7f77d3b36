"""The end of a run: its summary (a TrainSummary), recorded in the run record and written to summary.json."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpuwise.results import TrainSummary
from gpuwise.train.config import TrainConfig
from gpuwise.train.records import Recorder


def summarize(
    cfg: TrainConfig,
    rec: Recorder,
    *,
    rank_zero: bool,
    device_key: str,
    run_dir: Path,
    times: list[float],
    steps: int,
    steps_per_epoch: int,
    final_loss: float,
    evaluation: dict[str, Any],
    baseline: dict[str, Any],
    before: dict[str, Any] | None,
    tokens_per_sample: int | None,
    info: dict[str, Any],
    flops_per_step: float,
    peak: float | None,
    peak_origin: str,
    accelerator: str,
    world: int,
    precision: str,
    strategy: str,
    micro: int,
    share: int,
    oom_events: list[dict[str, int]],
    plan: dict[str, Any],
    peak_bytes: int | None,
    memory_method: str | None,
    files: list[str],
    elapsed_before: float,
    started: float,
) -> dict[str, Any] | None:
    """Summarize the run, record it (rank 0) and write summary.json; the summary as JSON on rank 0, else None.

    ``times``: seconds of each step run by this process; ``share``: samples per step of one process;
    ``elapsed_before``: seconds trained before a resume; ``started``: time.perf_counter() when this part began.
    """
    steady = times[1:] or times  # the first step pays for warm-up
    step_time = float(np.median(steady)) if steady else None
    samples_per_s = cfg.batch_size / step_time if step_time else None
    actual = {"peak_bytes": peak_bytes, "step_time_s": step_time, "method": memory_method}
    summary = TrainSummary.build(
        {
            "workload": cfg.workload,
            "run_dir": str(run_dir),
            "steps": steps,
            "epochs": steps / steps_per_epoch,
            "final_loss": final_loss,
            "eval": evaluation,
            "baseline": baseline or ({"name": "before training", **before} if before else {}),
            "throughput": {
                "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * tokens_per_sample if samples_per_s and tokens_per_sample else None,
            },
            "mfu": (flops_per_step / step_time / (peak * world)) if peak and step_time else None,
            "peak_flops": {"per_device": peak, "origin": peak_origin},
            "flops_per_step": flops_per_step,
            "device": f"{accelerator} x {world}",
            "precision": precision,
            "strategy": strategy,
            "global_batch": cfg.batch_size,
            "micro_batch": micro,
            "accumulation": math.ceil(share / micro),
            "oom_events": oom_events,
            "plan": plan,
            "actual": actual,
            "estimate_error": _errors(plan, actual),
            "data": info,
            "files": files,
            "wall_s": elapsed_before + time.perf_counter() - started,
        }
    )

    from gpuwise.train.report import projection

    summary.projection = projection(summary, cfg.workload_def().convolutional)
    if rank_zero:
        from gpuwise.runs.db import try_record

        summary.record_id = try_record("train", device_key, cfg.workload, summary.dump(), run_dir=str(run_dir))
    rec.summary(summary.dump())
    rec.close()
    return summary.dump() if rank_zero else None


def _errors(plan: dict[str, Any], actual: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in ("peak_bytes", "step_time_s"):
        if plan.get(key) and actual.get(key):
            out[key] = (plan[key] - actual[key]) / actual[key]
    return out
