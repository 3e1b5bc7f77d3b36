"""The end of a run: its summary (a TrainSummary), recorded in the run record and written to summary.json."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gpuwise.results import TrainSummary
from gpuwise.train.setup import Run


def summarize(
    run: Run,
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
    cfg, rec, work, run_dir, world, peak = run.cfg, run.rec, run.work, run.run_dir, run.world, run.peak
    steps, micro, plan, flops_per_step = run.step, run.micro or 1, run.plan, run.flops_per_step
    rank_zero, tokens = run.fabric.is_global_zero, work.tokens_per_sample
    assert cfg.batch_size is not None  # build() fills it from the workload's defaults
    steady = times[1:] or times  # the first step pays for warm-up
    step_time = float(np.median(steady)) if steady else None
    samples_per_s = cfg.batch_size / step_time if step_time else None
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
            "epochs": steps / run.steps_per_epoch,
            "final_loss": final_loss,
            "eval": evaluation,
            "baseline": work.baseline or ({"name": "before training", **before} if before else {}),
            "throughput": {
                "samples_per_s": samples_per_s,
                "tokens_per_s": samples_per_s * tokens if samples_per_s and tokens else None,
            },
            "mfu": (flops_per_step / step_time / (peak * world)) if peak and step_time else None,
            "peak_flops": {"per_device": peak, "origin": run.peak_origin},
            "flops_per_step": flops_per_step,
            "device": f"{run.accelerator} x {world}",
            "precision": run.precision,
            "strategy": run.strategy,
            "global_batch": cfg.batch_size,
            "micro_batch": micro,
            "accumulation": math.ceil(run.share / micro),
            "oom_events": run.oom_events,
            "plan": plan,
            "actual": actual,
            "estimate_error": _errors(plan, actual),
            "data": work.info,
            "files": files,
            "wall_s": run.elapsed_before + time.perf_counter() - started,
        }
    )

    from gpuwise.train.report import projection

    # a run of no steps of its own (a model assembled from its parts) has no time to project
    summary.projection = projection(summary, cfg.workload_def().convolutional) if steps else []
    if rank_zero:
        from gpuwise.runs.db import try_record

        summary.record_id = try_record("train", run.device_key, cfg.workload, summary.dump(), run_dir=str(run_dir))
    rec.summary(summary.dump())
    rec.close()
    return summary.dump() if rank_zero else None


def _errors(plan: dict[str, Any], actual: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in ("peak_bytes", "step_time_s"):
        if plan.get(key) and actual.get(key):
            out[key] = (plan[key] - actual[key]) / actual[key]
    return out
