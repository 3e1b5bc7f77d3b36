"""The end of a run: its summary (a TrainSummary), recorded in the run record and written to summary.json."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gpuwise.results import TrainSummary
from gpuwise.runs.db import try_record
from gpuwise.train.report import projection
from gpuwise.train.runplan import RunPlan
from gpuwise.train.setup import Progress, Run


def summarize(
    run: Run,
    plan: RunPlan,
    progress: Progress,
    *,
    times: list[float],
    final_loss: float,
    evaluation: dict[str, Any],
    before: dict[str, Any] | None,
    peak_bytes: int | None,
    memory_method: str | None,
    files: list[str],
    process_peak_bytes: int | None = None,
    started: float,
) -> dict[str, Any] | None:
    """Summarize the run, record it (rank 0) and write summary.json; the summary as JSON on rank 0, else None.

    ``times``: seconds of each step run by this process; ``started``: time.perf_counter() when this part
    began (the run's `elapsed_before` covers the parts before a resume).
    """
    lay, rec, work, run_dir = run.layout, run.rec, run.work, run.run_dir
    cfg, world, peak, figures = lay.cfg, lay.world, plan.peak, plan.figures
    steps, micro = progress.step, progress.micro or 1
    rank_zero, tokens = run.fabric.is_global_zero, work.tokens_per_sample
    steady = times[1:] or times  # the first step pays for warm-up
    step_time = float(np.median(steady)) if steady else None
    samples_per_s = lay.batch_size / step_time if step_time else None
    actual = {
        "peak_bytes": peak_bytes,
        "step_time_s": step_time,
        "method": memory_method,
        "process_peak_bytes": process_peak_bytes,
    }
    summary = TrainSummary.build(
        {
            "workload": cfg.workload,
            "run_dir": str(run_dir),
            "steps": steps,
            "epochs": steps / lay.steps_per_epoch,
            "final_loss": final_loss,
            "eval": evaluation,
            "baseline": work.baseline or ({"name": "before training", **before} if before else {}),
            "throughput": {
                "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * tokens if samples_per_s and tokens else None,
            },
            "mfu": (plan.flops_per_step / step_time / (peak * world)) if peak and step_time else None,
            "peak_flops": {"per_device": peak, "origin": plan.peak_origin},
            "flops_per_step": plan.flops_per_step,
            "device": f"{lay.accelerator} x {world}",
            "precision": lay.precision,
            "strategy": lay.strategy,
            "global_batch": lay.batch_size,
            "micro_batch": micro,
            "accumulation": math.ceil(lay.share / micro),
            "oom_events": progress.oom_events,
            "plan": dict(figures),
            "actual": actual,
            "estimate_error": _errors(figures, actual),
            "data": work.info,
            "files": files,
            "wall_s": progress.elapsed_before + time.perf_counter() - started,
        }
    )

    # a run of no steps of its own (a model assembled from its parts) has no time to project
    summary.projection = projection(summary, cfg.workload_def().convolutional) if steps else []
    summary.utilization = rec.usage()
    if rank_zero:
        summary.record_id = try_record("train", plan.device_key, cfg.workload, summary.dump(), run_dir=str(run_dir))
    rec.summary(summary.dump())
    rec.close()
    return summary.dump() if rank_zero else None


def _errors(plan: dict[str, Any], actual: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in ("peak_bytes", "step_time_s"):
        if plan.get(key) and actual.get(key):
            out[key] = (plan[key] - actual[key]) / actual[key]
    return out
