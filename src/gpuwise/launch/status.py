"""A launched job as `gpuwise runs` shows it: its state on the engine and, once its run has finished,
the run's summary, planned beside actual."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.results import LaunchRecord, TrainSummary


def summary_of(run_dir: str) -> TrainSummary | None:
    """The run's summary.json, where this machine sees the run directory (a shared file system)."""
    import json

    from gpuwise.files import read_run_file

    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    text = read_run_file(path, "run file", "the summary.json gpuwise train writes")
    try:
        return TrainSummary.load(json.loads(text))
    except (ValueError, TypeError) as e:  # ValidationError is a ValueError
        raise GpuwiseError(f"{path}: not a gpuwise summary ({str(e).splitlines()[0]})") from None


def status(record: LaunchRecord) -> dict[str, Any]:
    from gpuwise.launch.engines import engines

    engine = engines().get(record.engine)
    try:
        state = engine.state(record.job_id, record.engine_options) if engine else "UNKNOWN"
    except GpuwiseError as e:
        state = f"unknown ({e})"
    out: dict[str, Any] = {"state": state}
    try:
        summary = summary_of(record.run_dir)
    except GpuwiseError as e:
        out["summary_error"] = str(e)
        summary = None
    if summary is not None:
        plan = record.plan
        out["summary"] = summary.dump()
        out["planned_vs_actual"] = {
            "wall_s": [plan.get("wall_s"), summary.wall_s],
            "step_time_s": [plan.get("step_time_s"), summary.actual.step_time_s],
            "memory_per_gpu_bytes": [plan.get("memory_per_gpu_bytes"), summary.actual.peak_bytes],
        }
    return out


def headline(record: LaunchRecord) -> str:
    s = status(record)
    line = f"{record.engine} job {record.job_id}: {s['state']}"
    if "summary" in s:
        wall, step, _ = s["planned_vs_actual"].values()
        line += f"; {s['summary']['steps']} steps, wall {_s(wall[1])} (planned {_s(wall[0])})"
        line += f", step {_s(step[1])} (planned {_s(step[0])})"
    else:
        plan = record.plan
        line += f"; planned {_s(plan.get('wall_s'))} on {plan.get('gpus_per_node')} x {plan.get('nodes')}"
    return line


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g} s" if x < 120 else f"{x / 60:,.1f} min" if x < 7200 else f"{x / 3600:,.2f} h"
