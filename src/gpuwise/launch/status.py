"""A launched job as `gpuwise runs` shows it: its state on the engine and, once its run has finished,
the run's summary, planned beside actual."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import read_run_file
from gpuwise.launch.job import duration
from gpuwise.launch.registry import engines
from gpuwise.results import LaunchRecord, TrainSummary


def summary_of(run_dir: str) -> TrainSummary | None:
    """The run's summary.json, where this machine sees the run directory (a shared file system)."""
    import json

    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    text = read_run_file(path, "run file", "the summary.json gpuwise train writes")
    try:
        return TrainSummary.load(json.loads(text))
    except (ValueError, TypeError) as e:  # ValidationError is a ValueError
        raise GpuwiseError(f"{path}: not a gpuwise summary ({str(e).splitlines()[0]})") from None


def status(record: LaunchRecord) -> dict[str, Any]:
    engine = engines().get(record.engine)
    try:
        state = engine.state(record.job_id, record.engine_options) if engine else "UNKNOWN"
    except Exception as e:  # noqa: BLE001 - an engine's client answering oddly: the row says so, the list goes on

        state = f"unknown ({e if isinstance(e, GpuwiseError) else first_line(e)})"
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
        line += f"; {s['summary']['steps']} steps, wall {duration(wall[1])} (planned {duration(wall[0])})"
        line += f", step {duration(step[1])} (planned {duration(step[0])})"
    else:
        plan = record.plan
        line += f"; planned {duration(plan.get('wall_s'))} on {plan.get('gpus_per_node')} x {plan.get('nodes')}"
    return line

