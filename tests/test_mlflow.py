"""Issue #52, item 5: runs in MLflow, a view of gpuwise's record. A real `mlflow server` on loopback; what gpuwise
exported is read back with MLflow's own client and compared with the run's own files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from record_servers import MlflowServer

TESTS = Path(__file__).resolve().parent
GPUWISE = Path(sys.executable).parent / "gpuwise"
TINY = "tiny_workload:Tiny"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield s
    s.stop()


def gpuwise(tmp: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(TESTS), GPUWISE_DB=str(tmp / "runs.sqlite"), OMP_NUM_THREADS="1")
    return subprocess.run([str(GPUWISE), *argv], capture_output=True, text=True, timeout=timeout, env=env)


def train(tmp: Path, name: str, *extra: str) -> tuple[dict, Path, subprocess.CompletedProcess]:
    run_dir = tmp / name
    done = gpuwise(tmp, "train", TINY, "--max-steps", "4", "--checkpoint-every", "2", "--accelerator", "cpu",
                   "--run-dir", str(run_dir), "--json", *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), run_dir, done


def steps_of(run_dir: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def check_run(c: MlflowClient, run_id: str, summary: dict, run_dir: Path, tmp: Path) -> None:
    """The MLflow run holds what the record and the run directory hold: nothing rounded, nothing missing."""
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["gpuwise.record_id"] == str(summary["record_id"])
    history = sorted((m.step, m.value) for m in c.get_metric_history(run_id, "loss"))
    assert history == steps_of(run_dir, "loss") and len(history) == 4
    m = run.data.metrics
    assert m["plan.peak_bytes"] == summary["plan"]["peak_bytes"]
    assert m["actual.peak_bytes"] == summary["actual"]["peak_bytes"]
    assert m["actual.step_time_s"] == pytest.approx(summary["actual"]["step_time_s"], rel=1e-12)
    assert m["error.step_time_s"] == pytest.approx(summary["estimate_error"]["step_time_s"], rel=1e-12)
    for key, value in summary["eval"].items():
        if isinstance(value, int | float):
            assert m[f"eval.{key}"] == pytest.approx(value, rel=1e-12)
    assert run.data.params["max_steps"] == "4" and run.data.params["workload"] == TINY
    names = {a.path for a in c.list_artifacts(run_id)}
    assert {"config.yaml", "summary.json", "checkpoints_manifest.json", "loss.png"} <= names, names
    got = Path(c.download_artifacts(run_id, "checkpoints_manifest.json", str(tmp)))
    listed = {f["path"]: f for f in json.loads(got.read_text())["files"]}
    on_disk = [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file()]
    assert on_disk and set(listed) == {str(p.relative_to(run_dir)) for p in on_disk}
    for p in on_disk:
        assert listed[str(p.relative_to(run_dir))]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()


def test_an_exported_run_reads_back_in_mlflows_client_with_gpuwises_figures(server, tmp_path):
    summary, run_dir, _ = train(tmp_path, "a")
    done = gpuwise(tmp_path, "runs", "export", "--mlflow", server.uri, "--json")
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert row["record_id"] == summary["record_id"] and row["state"] == "exported"
    c = MlflowClient(server.uri)
    check_run(c, row["mlflow_run_id"], summary, run_dir, tmp_path)
    again = json.loads(gpuwise(tmp_path, "runs", "export", "--mlflow", server.uri, "--json").stdout)
    assert again == [row | {"state": "exported already"}]  # never a second MLflow run for one record


def test_train_logs_live_and_ends_as_one_complete_run(server, tmp_path):
    summary, run_dir, done = train(tmp_path, "live", "--mlflow", server.uri)
    live = json.loads((run_dir / "mlflow.json").read_text())
    assert live["tracking_uri"] == server.uri and "warning" not in done.stderr, done.stderr
    c = MlflowClient(server.uri)
    check_run(c, live["run_id"], summary, run_dir, tmp_path)
    exp = c.get_experiment_by_name("gpuwise")
    same = c.search_runs([exp.experiment_id], f"tags.`gpuwise.record_id` = '{summary['record_id']}'")
    assert [r.info.run_id for r in same if r.data.tags.get("gpuwise.run_dir") == str(run_dir)] == [live["run_id"]]


def test_mlflow_down_costs_a_run_one_line_and_export_one_error(tmp_path):
    down = "http://127.0.0.1:1"
    summary, run_dir, done = train(tmp_path, "down", "--mlflow", down)
    warnings = [line for line in done.stderr.splitlines() if "MLflow" in line]
    assert summary["steps"] == 4 and len(warnings) == 1 and "training goes on without it" in warnings[0], done.stderr
    assert (run_dir / "summary.json").is_file() and summary["record_id"] is not None
    failed = gpuwise(tmp_path, "runs", "export", "--mlflow", down, timeout=120)
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and "cannot reach MLflow" in failed.stderr, (
        failed.stderr
    )
