"""Training runs as MLflow runs: a view for teams that track runs in MLflow. gpuwise's record stays the source
of truth; nothing is read back from MLflow but whether a record was exported already.

One MLflow run per training record: its config as parameters, every step of metrics.jsonl as metrics at
that step, plan against actual as metrics (`plan.*`, `actual.*`, `error.*`) and tags, and as artifacts the
config, the summary, the checkpoints' manifest (names, sizes, SHA-256: the weights stay where they are) and
the loss curve. `gpuwise train --mlflow URI` creates the run while training (train/mlflow_live.py); this
module completes it at the end, so a live run and an exported one look the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import MAX_METRICS_BYTES, read_run_file
from gpuwise.report import plots
from gpuwise.results import TrainSummary
from gpuwise.runs import db
from gpuwise.train.mlflow_live import LIVE_FILE, bare

EXPERIMENT = "gpuwise"
RECORD_TAG = "gpuwise.record_id"  # the record's id, and where the record is (its password masked)
WHERE_TAG = "gpuwise.record"
BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics and 100 params per call
PARAM_BATCH = 100
MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value


def quiet_env() -> None:
    """MLflow's client prints a run's URL on every run it ends and retries a dead server for minutes: one
    try more, and no banner, so a server that is down costs a run one line, not a hang."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def client(uri: str):
    quiet_env()
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise GpuwiseError("--mlflow needs MLflow's client: pip install 'gpuwise[mlflow]'") from None
    return MlflowClient(tracking_uri=uri)


def experiment_id(c, name: str) -> str:
    found = c.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return c.create_experiment(name)


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = str(value)[:MAX_PARAM_CHARS]


def params_of(run_dir: Path, summary: TrainSummary) -> dict[str, str]:
    """The run's configuration: config.yaml, flattened, else what the summary knows."""
    out: dict[str, str] = {}
    try:
        cfg = yaml.safe_load(read_run_file(run_dir / "config.yaml", "run file", "config.yaml"))
    except (GpuwiseError, yaml.YAMLError):
        cfg = None
    if isinstance(cfg, dict):
        _flat("", cfg, out)
    for key in ("workload", "precision", "strategy", "device", "global_batch", "micro_batch", "accumulation"):
        out.setdefault(key, str(getattr(summary, key)))
    return out


def step_metrics(run_dir: Path) -> list[tuple[str, float, int]]:
    """(key, value, step) for every number metrics.jsonl holds, in its order."""
    try:
        text = read_run_file(run_dir / "metrics.jsonl", "run file", "metrics.jsonl", MAX_METRICS_BYTES)
    except GpuwiseError:
        return []
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a kill
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        out += [
            (k, float(v), row["step"])
            for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        ]
    return out


def summary_metrics(summary: TrainSummary) -> dict[str, float]:
    """Plan against actual, and the held-out figures: what a team compares runs by."""
    out: dict[str, float | None] = {
        "plan.peak_bytes": summary.plan.peak_bytes,
        "plan.step_time_s": summary.plan.step_time_s,
        "actual.peak_bytes": summary.actual.peak_bytes,
        "actual.step_time_s": summary.actual.step_time_s,
        "error.peak_bytes": summary.estimate_error.peak_bytes,
        "error.step_time_s": summary.estimate_error.step_time_s,
        "mfu": summary.mfu,
        "wall_s": summary.wall_s,
        "samples_per_s": summary.throughput.samples_per_s,
        "tokens_per_s": summary.throughput.tokens_per_s,
        "final_loss": summary.final_loss,
    }
    out |= {f"eval.{k}": v for k, v in summary.eval.items()}
    return {k: float(v) for k, v in out.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def manifest(run_dir: Path) -> dict[str, Any]:
    """The checkpoints and saved model files: name, bytes, SHA-256 (files inside the run directory only)."""
    root = run_dir.resolve()
    files = []
    for folder in ("checkpoints", "model"):
        base = root / folder
        if not base.is_dir() or base.is_symlink():
            continue
        for p in sorted(base.rglob("*")):
            if p.is_symlink() or not p.is_file() or not p.resolve().is_relative_to(root):
                continue
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            files.append({"path": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": h.hexdigest()})
    return {"run_dir": str(run_dir), "files": files}


def exported_run(c, exp_id: str, record_id: int, where: str) -> str | None:
    """The MLflow run this record was exported to already, if any."""
    found = c.search_runs(
        [exp_id], filter_string=f"tags.`{RECORD_TAG}` = '{record_id}' and tags.`{WHERE_TAG}` = '{where}'",
        max_results=1,
    )
    return found[0].info.run_id if found else None


def log_record(c, run_id: str, row: dict[str, Any], summary: TrainSummary, with_steps: bool) -> None:
    """Everything a finished training record holds, into one MLflow run; the run then ends FINISHED."""
    from mlflow.entities import Metric, Param, RunTag

    run_dir = Path(row["run_dir"] or summary.run_dir)
    now_ms = int(time.time() * 1000)
    tags = {
        RECORD_TAG: str(row["id"]),
        WHERE_TAG: str(db.where()),
        "gpuwise.workload": summary.workload,
        "gpuwise.device": row["device"],
        "gpuwise.run_dir": str(run_dir),
        "gpuwise.plan.method": summary.plan.method or "",
        "gpuwise.plan.step_time_basis": (summary.plan.efficiency_origin or summary.plan.time_origin or "")[:5000],
    }
    c.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    params = list(params_of(run_dir, summary).items())
    have = set(c.get_run(run_id).data.params)  # a live run logged its params already: MLflow refuses a change
    params = [(k, v) for k, v in params if k not in have]
    for i in range(0, len(params), PARAM_BATCH):
        c.log_batch(run_id, params=[Param(k, v) for k, v in params[i : i + PARAM_BATCH]])
    metrics = [Metric(k, v, now_ms, summary.steps) for k, v in summary_metrics(summary).items()]
    if with_steps:
        metrics += [Metric(k, v, now_ms, step) for k, v, step in step_metrics(run_dir)]
    for i in range(0, len(metrics), BATCH):
        c.log_batch(run_id, metrics=metrics[i : i + BATCH])
    with tempfile.TemporaryDirectory(prefix="gpuwise-mlflow-") as tmp:
        out = Path(tmp)
        (out / "summary.json").write_text(json.dumps(summary.dump(), indent=2))
        (out / "checkpoints_manifest.json").write_text(json.dumps(manifest(run_dir), indent=2))
        config = run_dir / "config.yaml"
        if config.is_file() and not config.is_symlink():
            (out / "config.yaml").write_text(read_run_file(config, "run file", "config.yaml"))
        losses = [(s, v) for k, v, s in step_metrics(run_dir) if k == "loss"]
        if losses:
            png = plots.loss_curve([s for s, _ in losses], [v for _, v in losses], [], f"{summary.workload}: loss")
            (out / "loss.png").write_bytes(png)
        c.log_artifacts(run_id, str(out))
    c.set_terminated(run_id, "FINISHED")


def export(uri: str, ids: list[int] | None = None, experiment: str = EXPERIMENT) -> list[dict[str, Any]]:
    """Every training record (or those of `ids`) as an MLflow run: one row per record, saying which run it is
    and whether it was written now or found exported already."""
    rows = [db.get(i) for i in ids] if ids else db.rows("train")
    c = client(uri)
    try:
        exp_id = experiment_id(c, experiment)
    except Exception as e:  # noqa: BLE001 - MLflow raises MlflowException or requests' errors
        raise GpuwiseError(f"cannot reach MLflow at {uri}: {first_line(e)}") from None
    where = str(db.where())
    out = []
    for row in rows:
        if row["kind"] != "train":
            raise GpuwiseError(f"record #{row['id']} is a {row['kind']} record: only training runs go to MLflow")
        summary = db.load_data(row, TrainSummary)
        done = exported_run(c, exp_id, row["id"], where)
        if done:
            out.append({"record_id": row["id"], "mlflow_run_id": done, "state": "exported already"})
            continue
        live = _live_run(Path(row["run_dir"] or summary.run_dir), uri)
        if live is not None:  # logged while training: complete that run rather than make a second one
            log_record(c, live, row, summary, with_steps=False)
            out.append({"record_id": row["id"], "mlflow_run_id": live, "state": "completed (logged live)"})
            continue
        run = c.create_run(exp_id, run_name=f"{summary.workload} #{row['id']}")
        log_record(c, run.info.run_id, row, summary, with_steps=True)
        out.append({"record_id": row["id"], "mlflow_run_id": run.info.run_id, "state": "exported"})
    return out


def _live_run(run_dir: Path, uri: str) -> str | None:
    try:
        live = json.loads(read_run_file(run_dir / LIVE_FILE, "run file", LIVE_FILE))
    except (GpuwiseError, ValueError):
        return None
    if isinstance(live, dict) and live.get("tracking_uri") == bare(uri) and isinstance(live.get("run_id"), str):
        return live["run_id"]
    return None
