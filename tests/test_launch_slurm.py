"""`gpuwise launch slurm --submit` on a real one-node Slurm cluster (slurmctld + slurmd on localhost, started by
tests/engines/slurm_local.sh; Debian's slurm-wlm and munge, installed by it or by .ci/run): the script trains,
and a job that gets its checkpoint signal is requeued and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from gpuwise.cli import main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="Slurm's daemons run as root here (SlurmUser=root)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    where = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(ROOT / "tests/engines/slurm_local.sh"), "up", str(where)],
                        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert up.returncode == 0, up.stderr[-2000:]
    conf = str(where / "slurm.conf")
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run(["bash", str(ROOT / "tests/engines/slurm_local.sh"), "down", str(where)], capture_output=True)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from train_data import interactions_csv

    return interactions_csv(tmp_path_factory.mktemp("data") / "interactions.csv")


def job(data: Path, steps: int) -> list[str]:
    return ["train", "recommender", "--data", str(data), "--model", "mf", "--batch-size", "8", "--max-steps",
            str(steps), "--precision", "32-true"]  # fmt: skip


def submit(capsys, run_dir: Path, argv: list[str]) -> dict:
    assert main(["launch", "slurm", "--gpu", "cpu", "--gpus", "2", "--submit", "--run-dir", str(run_dir), "--json",
                 "--", *argv]) == 0, capsys.readouterr().err  # fmt: skip
    return json.loads(capsys.readouterr().out)


def finished(record_id: int, timeout: float = 300) -> dict:
    from gpuwise.launch.status import status
    from gpuwise.results import LaunchRecord
    from gpuwise.runs import db

    deadline = time.monotonic() + timeout
    while True:
        now = status(db.load_data(db.get(record_id), LaunchRecord))
        if now["state"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"):
            return now
        assert time.monotonic() < deadline, f"the job is still {now['state']} after {timeout} s"
        time.sleep(1)


@pytest.mark.slow
def test_the_script_trains_and_runs_shows_the_job(slurm, data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = submit(capsys, tmp_path / "run", job(data, 4))
    script = Path(out["artifact"]).read_text()
    assert "#SBATCH --ntasks-per-node=1" in script and "--gpus-per-node" not in script  # CPU nodes: no GPU request
    now = finished(out["record_id"])
    assert now["state"] == "COMPLETED", now
    assert now["summary"]["device"] == "cpu x 2" and now["summary"]["steps"] == 4
    assert main(["runs"]) == 0
    listed = capsys.readouterr().out
    assert f"slurm job {out['job_id']}:" in listed and "COMPLETED;" in listed  # its state, planned beside actual


@pytest.mark.slow
def test_a_launched_job_writes_its_run_into_the_teams_postgresql(slurm, data, postgres, tmp_path, capsys, monkeypatch):
    """Issue #52: the job on the node writes its run where the launch was recorded: the team's PostgreSQL. The
    address reaches it through sbatch's environment; the script holds no address, and no password goes anywhere."""
    from gpuwise.runs import db

    url = postgres.database()
    monkeypatch.setenv("GPUWISE_DB", url)  # as `gpuwise --db URL launch ...` sets it; PGPASSFILE from the fixture
    monkeypatch.chdir(tmp_path)
    out = submit(capsys, tmp_path / "run", job(data, 2))
    assert "postgresql" not in Path(out["artifact"]).read_text() and postgres.password not in out["artifact"]
    now = finished(out["record_id"])
    assert now["state"] == "COMPLETED", now
    trained = db.rows("train")
    assert len(trained) == 1 and trained[0]["run_dir"] == str(tmp_path / "run"), trained
    assert trained[0]["data"]["steps"] == 2 and trained[0]["id"] > out["record_id"]  # written by the job, later
    assert db.get(out["record_id"])["kind"] == "launch"  # the launch, in the same record


@pytest.mark.slow
def test_a_signalled_job_checkpoints_is_requeued_and_resumes(slurm, data, tmp_path, capsys, monkeypatch):
    from test_train_loop import assert_same_training, torchrun

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    steps = 800
    out = submit(capsys, run, job(data, steps))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 20):
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)
    # What Slurm sends --signal=B:USR1@120 before the time limit, sent now.
    subprocess.run(["scancel", "--batch", "--signal=USR1", out["job_id"]], check=True)
    now = finished(out["record_id"])
    assert now["state"] == "COMPLETED", now
    shown = subprocess.run(["scontrol", "-o", "show", "job", out["job_id"]], capture_output=True, text=True).stdout
    assert "Restarts=1" in shown
    log = next(run.parent.glob(f"run-slurm-{out['job_id']}.out")).read_text(errors="replace")
    stopped = [line for line in log.splitlines() if "stopped by SIGTERM at step" in line]
    assert stopped and "requeueing job" in log
    at = int(stopped[0].split("at step ")[1].split(";")[0])
    assert 0 < at < steps and f"resuming {run} at step {at}" in log
    assert now["summary"]["steps"] == steps
    torchrun([*job(data, steps), "--run-dir", str(tmp_path / "local"), "--devices", "2", "--accelerator", "cpu"], 29531)
    assert_same_training(tmp_path / "local", run)


def test_a_layout_the_cluster_cannot_hold_is_refused_before_submitting(slurm, data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout
    for flags, said in ((["--gpu", "cpu", "--gpus", "4"], "More processors requested than permitted"),
                        (["--gpu", "l4"], "Invalid generic resource (gres) specification")):  # fmt: skip
        assert main(["launch", "slurm", *flags, "--submit", "--", *job(data, 4)]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("gpuwise: error: Slurm cannot run the job:") and said in err, err
    after = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout
    assert after == before  # nothing submitted
    assert not list(tmp_path.glob("gpuwise-*"))  # nor written


@pytest.mark.slow
def test_an_endpoint_serves_the_openai_client_and_scancel_drains_it(slurm, tmp_path, capsys, monkeypatch):
    from test_launch_endpoint import SMOL, answers_and_drains

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPUWISE_API_KEY", raising=False)
    assert main(["launch", "slurm", "--gpu", "cpu", "--submit", "--run-dir", str(tmp_path / "endpoint"), "--json",
                 "--", "serve", SMOL, "--max-seqs", "4", "--no-record"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert "--api-key-file" in out["text"] and "unset GPUWISE_API_KEY" in out["text"]
    answers_and_drains(out["record_id"], Path(out["artifact"]), capsys, monkeypatch)
    assert main(["runs"]) == 0
    listed = capsys.readouterr().out
    assert f"slurm endpoint {out['job_id']}:" in listed and "1 replica;" in listed
