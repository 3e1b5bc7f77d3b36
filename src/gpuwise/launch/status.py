"""A launched job as `gpuwise runs` shows it: its state on the engine and, once its run has finished,
the run's summary, planned beside actual."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import read_key_file, read_run_file
from gpuwise.launch.endpoint import addresses
from gpuwise.launch.engines import STATE_TIMEOUT_S, run_client
from gpuwise.launch.job import duration
from gpuwise.launch.registry import engines
from gpuwise.results import LaunchRecord, TrainSummary
from gpuwise.runs import db


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
    if record.engine_options.get("endpoint"):  # where its replicas answer: what they announced, or the engine's
        try:
            out["addresses"] = endpoint_urls(record)
        except Exception as e:  # noqa: BLE001 - the engine's client answering oddly: said, the list goes on
            out["addresses"], out["address_error"] = [], str(e) if isinstance(e, GpuwiseError) else first_line(e)
        return out
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


def endpoint_urls(record: LaunchRecord) -> list[str]:
    """The URLs of an endpoint's replicas (Slurm, Ray: as each announced it), or of the engine's front for them
    (Kubernetes: the Service's name in the cluster's DNS; SkyPilot: `sky serve status --endpoint`)."""
    if record.engine in ("slurm", "ray"):
        return [a["url"] for a in addresses(record.run_dir)]
    if record.engine == "k8s":
        ns = record.engine_options.get("namespace") or "default"
        return [f"http://{record.job_id}.{ns}.svc.cluster.local/v1"]
    engine = engines()["skypilot"]
    out = run_client([engine.need_client(), "serve", "status", "--endpoint", record.job_id], "sky serve status",
                     timeout=STATE_TIMEOUT_S).strip()  # fmt: skip
    return [f"{out if '://' in out else 'http://' + out}/v1"] if out else []


def headline(record: LaunchRecord) -> str:
    s = status(record)
    if record.engine_options.get("endpoint"):
        where = ", ".join(s["addresses"]) or "no address announced"
        n = record.plan.get("replicas") or record.engine_options.get("replicas") or 1
        return f"{record.engine} endpoint {record.job_id}: {s['state']}, {n} replica{'s' * (n > 1)}; {where}"
    line = f"{record.engine} job {record.job_id}: {s['state']}"
    if "summary" in s:
        wall, step, _ = s["planned_vs_actual"].values()
        line += f"; {s['summary']['steps']} steps, wall {duration(wall[1])} (planned {duration(wall[0])})"
        line += f", step {duration(step[1])} (planned {duration(step[0])})"
    else:
        plan = record.plan
        line += f"; planned {duration(plan.get('wall_s'))} on {plan.get('gpus_per_node')} x {plan.get('nodes')}"
    return line



def endpoint_of(record_id: int) -> tuple[str, str | None]:
    """(URL, key) of a launched endpoint by its record id: how `gpuwise chat ID` and the ui reach it. The key is
    read from the endpoint's key file (only its owner can read it); none where the engine's secret holds it."""
    row = db.get(record_id)
    rec = db.load_data(row, LaunchRecord) if row["kind"] == "launch" else None
    if rec is None or not rec.engine_options.get("endpoint"):
        raise GpuwiseError(f"record #{record_id} is not a launched endpoint (gpuwise runs lists them)")
    urls = endpoint_urls(rec)
    if not urls:
        raise GpuwiseError(f"endpoint #{record_id} ({rec.engine} job {rec.job_id}) has announced no address yet: "
                           "its replicas are starting, or have stopped (gpuwise runs shows its state)")  # fmt: skip
    key_file = rec.engine_options.get("key_file")
    key = None
    if key_file:
        key = read_key_file(Path(key_file))
    return urls[0], key


def stop(record_id: int) -> tuple[str, LaunchRecord]:
    """`gpuwise launch --stop ID`: the recorded job or endpoint ended through its engine's client; what it said."""
    row = db.get(record_id)
    if row["kind"] != "launch":
        raise GpuwiseError(f"record #{record_id} is a {row['kind']}, not a launched job or endpoint")
    rec = db.load_data(row, LaunchRecord)
    engine = engines().get(rec.engine)
    if engine is None:
        raise GpuwiseError(f"record #{record_id}: unknown engine {rec.engine!r}")
    return engine.stop(rec.job_id, rec.engine_options), rec
