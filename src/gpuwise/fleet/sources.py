"""Where the fleet's figures come from: one `Use` per job, from Slurm's accounting (every job, not only
gpuwise's), Ray's Jobs API, and gpuwise's own record (local runs, serving sessions, launched jobs and the
utilization their runs measured). Each reader says in one line when its source is not there."""

from __future__ import annotations

import calendar
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import read_run_file
from gpuwise.hardware.usage import USAGE_FILE
from gpuwise.runs import db

SACCT_FIELDS = ("JobID", "JobName", "Account", "User", "State", "ElapsedRaw", "AllocTRES", "Start", "End", "Partition")


@dataclass(frozen=True)
class Use:
    """One job's hold on devices: who, what, how many, how long, and how much of them it used."""

    source: str  # slurm | ray | gpuwise
    job: str  # the engine's job id, or "record #N"
    name: str
    user: str
    team: str
    workload: str
    engine: str  # slurm | ray | local | endpoint
    gpu: str  # a catalog slug, a site's GPU type (Slurm's gres type), "gpu" (untyped) or "cpu"
    devices: float  # GPUs held (CPU cores for a job without GPUs)
    start: float  # epoch seconds
    end: float | None  # None: still running
    state: str
    util: float | None = None  # mean utilization of the devices held, 0..1, where it was measured
    idle_share: float | None = None
    idle_tail_s: float | None = None  # seconds idle at the end (a running job's idle time so far)
    util_source: str | None = None
    run_dir: str | None = None
    window_start: float | None = None  # the fleet's --since: hours before it count in no figure

    def seconds(self, now: float) -> float:
        """The job's whole time, as its engine counts it."""
        return max(0.0, (self.end if self.end is not None else now) - self.start)

    def device_hours(self, now: float) -> float:
        """Device-hours within the window: a 90-day endpoint counts 30 days in a 30-day view."""
        begin = max(self.start, self.window_start) if self.window_start is not None else self.start
        return self.devices * max(0.0, (self.end if self.end is not None else now) - begin) / 3600

    @property
    def running(self) -> bool:
        return self.end is None


def _epoch(text: str) -> float | None:
    """sacct's local time (2026-12-06T03:10:02), or None for Unknown / None."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def _tres(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if "=" in part)


def parse_sacct(text: str, now: float) -> list[Use]:
    """`sacct -a -X -P -n --format=` SACCT_FIELDS, one allocation per line."""
    out = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != len(SACCT_FIELDS):
            continue
        row = dict(zip(SACCT_FIELDS, parts, strict=True))
        tres = _tres(row["AllocTRES"])
        start = _epoch(row["Start"])
        if start is None:  # still pending: it holds nothing yet
            continue
        typed = [(k.split(":", 1)[1], v) for k, v in tres.items() if k.startswith("gres/gpu:")]
        if tres.get("gres/gpu"):
            gpu, devices = (typed[0][0] if len(typed) == 1 else "gpu"), float(tres["gres/gpu"])
        else:
            gpu, devices = "cpu", float(tres.get("cpu", 0) or 0)
        state = row["State"].split()[0]  # "CANCELLED by 0" -> CANCELLED
        end = _epoch(row["End"]) if state not in ("RUNNING", "SUSPENDED", "REQUEUED") else None
        if end is None and state not in ("RUNNING", "SUSPENDED", "REQUEUED"):
            end = start + float(row["ElapsedRaw"] or 0)
        if end is not None and row["ElapsedRaw"].isdigit():
            end = start + int(row["ElapsedRaw"])  # sacct's own seconds, exactly
        out.append(Use("slurm", row["JobID"], row["JobName"], row["User"], row["Account"] or "-", row["JobName"],
                       "slurm", gpu, devices, start, end, state))  # fmt: skip
    return out


def slurm_jobs(since: float, now: float) -> tuple[list[Use], str | None]:
    """Every job Slurm's accounting holds since `since` (all users), or a note saying why none."""
    sacct = shutil.which("sacct") or (shutil.which("sacct", path="/usr/bin:/usr/sbin"))
    if sacct is None:
        return [], None  # no Slurm here: nothing to say
    fmt = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
    argv = [sacct, "-a", "-X", "-P", "-n", "-S", fmt, "-E", "now", f"--format={','.join(SACCT_FIELDS)}"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"Slurm's accounting: sacct gave no answer ({first_line(e)})"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return [], f"Slurm's accounting: {said[:200]}"
    return parse_sacct(done.stdout, now), None


def ray_jobs(address: str, since: float) -> tuple[list[Use], str | None]:
    """The jobs of a Ray cluster (its Jobs API): start and end to the millisecond, and for a job gpuwise launched
    the layout gpuwise put in its metadata (the Jobs API reports no job's resources)."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        return [], "Ray: its client is not installed (pip install 'gpuwise[ray]')"
    try:
        jobs = JobSubmissionClient(address).list_jobs()
    except Exception as e:  # noqa: BLE001 - ConnectionError and Ray's own
        return [], f"Ray at {address}: {first_line(e)}"
    out = []
    for j in jobs:
        if not j.start_time or j.start_time / 1000 < since and j.end_time and j.end_time / 1000 < since:
            continue
        meta = j.metadata or {}
        # Ray's JobDetails carries no resources (its JobInfo does, inside the cluster): a job gpuwise launched
        # names its own in its metadata; any other counts its time, with no devices
        gpus = float(meta.get("gpuwise_gpus") or getattr(j, "entrypoint_num_gpus", None) or 0)
        cpus = float(meta.get("gpuwise_cpus") or getattr(j, "entrypoint_num_cpus", None) or 0)
        gpu = meta.get("gpuwise_gpu") or ("gpu" if gpus else "cpu")
        end = j.end_time / 1000 if j.end_time else None
        status = str(getattr(j.status, "value", j.status))
        out.append(Use("ray", j.submission_id or j.job_id or "?", meta.get("gpuwise_workload") or j.entrypoint[:40],
                       meta.get("gpuwise_user") or "-", meta.get("gpuwise_team") or "-",
                       meta.get("gpuwise_workload") or "-", "ray", gpu if gpus else "cpu", gpus or cpus,
                       j.start_time / 1000, end, status, run_dir=meta.get("gpuwise_run_dir")))  # fmt: skip
    return out, None


def _usage_at(path: Path, summary: bool) -> dict[str, Any] | None:
    try:
        data = json.loads(read_run_file(path, "run file", path.name))
    except (GpuwiseError, ValueError, RecursionError):
        return None
    usage = data.get("utilization") if summary and isinstance(data, dict) else data
    return usage if isinstance(usage, dict) and isinstance(usage.get("mean"), int | float) else None


def run_usage(run_dir: str | None) -> dict[str, Any] | None:
    """A run's utilization: its summary's, else RUN/usage.json (a run still going rewrites it); an endpoint's
    folder holds one per replica (replica-N.usage.json): their mean, weighted by samples, idle only while all are."""
    if not run_dir:
        return None
    folder = Path(run_dir)
    found = _usage_at(folder / "summary.json", True) or _usage_at(folder / USAGE_FILE, False)
    if found or not folder.is_dir():
        return found
    parts = [u for p in sorted(folder.glob("*.usage.json"))[:256] if (u := _usage_at(p, False))]
    if not parts:
        return None
    n = sum(int(u.get("samples") or 1) for u in parts)
    weighted = lambda key: sum(float(u.get(key) or 0) * int(u.get("samples") or 1) for u in parts) / n  # noqa: E731
    return parts[0] | {"mean": weighted("mean"), "idle_share": weighted("idle_share"), "samples": n,
                       "idle_tail_s": min(float(u.get("idle_tail_s") or 0) for u in parts),
                       "replicas": len(parts)}  # fmt: skip


def with_usage(u: Use, usage: dict[str, Any] | None) -> Use:
    if not usage:
        return u
    return replace(u, util=usage.get("mean"), idle_share=usage.get("idle_share"), idle_tail_s=usage.get("idle_tail_s"),
                   util_source=f"gpuwise ({usage.get('kind')}, {usage.get('samples')} samples)")  # fmt: skip


def _iso(text: str) -> float:
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))


@dataclass(frozen=True)
class Served:
    """What one serving session served, for the hosted API's price of the same tokens."""

    model: str
    gpu: str
    devices: float
    seconds: float  # the server's life
    requests: int
    tokens_in: float
    tokens_out: float


def record_uses(
    since: float, now: float, served: list[Served] | None = None
) -> tuple[list[Use], dict[tuple[str, str], dict], str | None]:
    """gpuwise's own record: local training runs and serving sessions as uses; and by (engine, job id) the jobs
    gpuwise launched and the runs measured inside an engine's job (summary.utilization.job), so that a Slurm or
    Ray job gets its workload, team and measured use."""
    try:
        rows = db.rows()
    except GpuwiseError as e:
        return [], {}, f"gpuwise's record: {e}"
    uses: list[Use] = []
    launched: dict[tuple[str, str], dict] = {}
    trained_in = {r["run_dir"]: r for r in rows if r["kind"] == "train" and r["run_dir"]}
    launched_dirs = {r["data"].get("run_dir") for r in rows if r["kind"] == "launch"}
    for r in rows:
        d = r["data"]
        try:
            end = _iso(r["created"])
        except ValueError:
            continue
        user, team = r.get("user") or "-", r.get("team") or r.get("user") or "-"
        if r["kind"] == "launch":
            launched[(str(d.get("engine")), str(d.get("job_id")))] = {
                "workload": d.get("workload"), "user": user, "team": team, "run_dir": d.get("run_dir"),
                "endpoint": bool((d.get("engine_options") or {}).get("endpoint")),
                "train": trained_in.get(d.get("run_dir")),
            }  # fmt: skip
            continue
        used = d.get("utilization") if isinstance(d.get("utilization"), dict) else {}
        inside = used.get("job") if isinstance(used.get("job"), dict) else None
        if inside and r["kind"] in ("train", "serve"):  # measured inside an engine's job: that job is the use
            launched.setdefault((str(inside.get("engine")), str(inside.get("id"))), {
                "workload": r["name"], "user": user, "team": team, "run_dir": r["run_dir"], "endpoint":
                r["kind"] == "serve", "train": r if r["kind"] == "train" else None, "usage": used})  # fmt: skip
            continue
        if end < since:
            continue
        if r["kind"] == "train" and r["run_dir"] not in launched_dirs:  # a launched run counts as its job
            wall = float(d.get("wall_s") or 0)
            kind, _, n = str(d.get("device") or "cpu x 1").partition(" x ")
            devices = float(n or 1)
            gpu = r["device"].split(":", 1)[1] if r["device"].startswith("cuda:") else "cpu"
            if gpu == "cpu":
                devices = float((d.get("utilization") or {}).get("count") or devices)
            uses.append(with_usage(Use("gpuwise", f"record #{r['id']}", r["name"], user, team, r["name"], "local",
                                       gpu, devices, end - wall, end, "COMPLETED", run_dir=r["run_dir"]),
                                   d.get("utilization")))  # fmt: skip
        elif r["kind"] == "serve":
            used = d.get("utilization") or {}
            actual = d.get("actual") if isinstance(d.get("actual"), dict) else {}
            span = float(actual.get("seconds_up") or used.get("seconds") or 0)
            gpu = r["device"].split(":", 1)[1] if r["device"].startswith("cuda:") else "cpu"
            devices = float(used.get("count") or 1)
            asked = int(actual.get("requests") or 0)
            if served is not None:  # tokens: requests x their mean lengths (the session keeps means, not sums)
                served.append(Served(r["name"], gpu, devices, span, asked,
                                     asked * float(actual.get("prompt_tokens") or 0),
                                     asked * float(actual.get("output_tokens") or 0)))  # fmt: skip
            uses.append(with_usage(Use("gpuwise", f"record #{r['id']}", r["name"], user, team, r["name"], "endpoint",
                                       gpu, devices, end - span, end, "STOPPED"), d.get("utilization")))  # fmt: skip
    return uses, launched, None


def join(uses: list[Use], launched: dict[tuple[str, str], dict]) -> list[Use]:
    """A Slurm or Ray job gpuwise launched: its workload, its launcher's team where the engine has none, and
    the utilization its run measured (summary.json when done, usage.json while it runs)."""
    out = []
    for u in uses:
        found = launched.get((u.source, u.job)) or launched.get((u.source, u.job.split("_")[0]))
        if found is None:
            out.append(u)
            continue
        usage = found.get("usage")
        if found.get("train"):
            usage = found["train"]["data"].get("utilization") or usage
        usage = usage or run_usage(found.get("run_dir"))
        team = u.team if u.team not in ("-", "") else found["team"]
        user = u.user if u.user not in ("-", "") else found["user"]
        engine = "endpoint" if found["endpoint"] else u.engine
        out.append(with_usage(replace(u, workload=found["workload"] or u.workload, team=team, user=user, engine=engine,
                                      run_dir=found.get("run_dir")), usage))  # fmt: skip
    return out
