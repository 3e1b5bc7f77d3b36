"""A run directory is never overwritten, mixed with another, or trusted: real processes for the races,
planted files for the loads, and one line for every bad input to train, predict, serve and export."""

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gpuwise.cli import main

from train_data import image_folder

GPUWISE = [sys.executable, "-m", "gpuwise"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("cells"))


def defects(cells, run_dir, *extra) -> list[str]:
    return ["train", "defects", "--data", str(cells), "--image-size", "32", "--batch-size", "8",
            "--run-dir", str(run_dir), *extra]


def cli(args, **kw):
    return subprocess.run(GPUWISE + args, capture_output=True, text=True, **kw)


def one_line(capsys, argv, needle: str | tuple[str, ...]) -> str:
    """Exit 2, one line on stderr, holding `needle` (or one of several)."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    needles = needle if isinstance(needle, tuple) else (needle,)
    assert any(n in err for n in needles) and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def finished(cells, tmp_path_factory):
    """A finished defects run (2 steps, checkpoints at 1 and 2), copied by each test that breaks it. Trained in a
    process of its own, as the resumes that are compared with it bitwise are: pytest's own process carries what
    earlier tests left in torch (its threads), and a step computed with other threads is not bitwise the same."""
    run = tmp_path_factory.mktemp("finished") / "run"
    env = dict(os.environ, GPUWISE_DB=str(run.parent / "runs.sqlite"))  # not conftest's per-test record
    done = cli(defects(cells, run, "--max-steps", "2", "--checkpoint-every", "1"), env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy"))


# --- 1. Nothing in a run directory runs code --------------------------------------------------------------


class Planted:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PLANTED_MARKER']}",))


def rewrite_manifest(ckpt: Path) -> None:
    """What an attacker does: the manifest proves wholeness, not origin, so it is rewritten to match."""
    import hashlib

    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    digests = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    (ckpt / "manifest.json").write_text(json.dumps({"step": 0, "sha256": digests}))


def test_a_planted_checkpoint_runs_nothing_and_resume_falls_back(finished, tmp_path, monkeypatch):
    run = copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    state = run / "checkpoints" / "step-000002" / "state.ckpt"
    good = torch.load(state, weights_only=True)
    good["rng"] = Planted()  # a matching manifest, a valid zip, and a pickle that calls os.system
    torch.save(good, state)
    rewrite_manifest(state.parent)
    for f in ("summary.json", "model.safetensors"):
        (run / f).unlink()
    again = cli(["train", "--resume", str(run)])
    assert again.returncode == 0, again.stderr
    assert not marker.exists(), "the planted pickle ran"
    assert "checkpoint step-000002 is corrupt (does not load: UnpicklingError" in again.stderr
    assert "resuming" in again.stderr and "from step-000001" in again.stderr
    a, b = load_file(str(finished / "model.safetensors")), load_file(str(run / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # step 2 redone from step 1: bitwise the same


def test_the_distributed_checkpoint_index_loads_only_its_own_classes(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from gpuwise.train.checkpoint import _IndexUnpickler, _safe_dcp

    model = torch.nn.Linear(4, 3)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict(), "lr": 0.5}, checkpoint_id=tmp_path / "ck")
    Reader, Planner = _safe_dcp()
    back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "lr": 0.0}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(back, storage_reader=Reader(tmp_path / "ck"), planner=Planner())
    assert torch.equal(back["model"]["weight"], model.weight) and back["lr"] == 0.5

    monkeypatch.setenv("PLANTED_MARKER", str(tmp_path / "pwned"))
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Planted()))
    with open(tmp_path / "ck" / ".metadata", "rb") as f, pytest.raises(Exception, match="posix.system is not allowed"):
        _IndexUnpickler(f).load()
    with pytest.raises(BaseException, match="not allowed in a checkpoint index"):  # dcp's CheckpointException
        dcp.load(back, storage_reader=Reader(tmp_path / "ck"), planner=Planner())
    assert not (tmp_path / "pwned").exists()


# --- 3. No run is overwritten or mixed with another ----------------------------------------------------------


def test_default_names_are_unique_within_a_second(tmp_path, monkeypatch):
    from gpuwise.train.config import TrainConfig
    from gpuwise.train.records import RunClaim

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda *_: "20261130-120000")
    claims = [RunClaim.new(TrainConfig(workload="defects")) for _ in range(3)]
    assert [c.path.name for c in claims] == ["defects-20261130-120000", "defects-20261130-120000-2",
                                             "defects-20261130-120000-3"]
    for c in claims:
        c.release()


def test_two_processes_on_one_run_dir_one_is_refused(cells, tmp_path):
    run = tmp_path / "shared"
    first = subprocess.Popen(GPUWISE + defects(cells, run, "--max-steps", "400", "--checkpoint-every", "1000"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.05)
        second = cli(defects(cells, run, "--max-steps", "2"))
        assert second.returncode == 2
        assert f"{run} is in use by another gpuwise process (pid {first.pid})" in second.stderr
        resumed = cli(["train", "--resume", str(run)])
        assert resumed.returncode == 2 and "in use by another gpuwise process" in resumed.stderr
    finally:
        first.terminate()
        first.wait(60)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "two processes wrote one metrics.jsonl"


def test_a_directory_that_is_not_a_run_is_left_untouched(cells, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my own weights")
    (mine / "summary.json").write_text("my notes")
    one_line(capsys, defects(cells, mine, "--max-steps", "1"), "is not empty and is not a gpuwise run")
    assert sorted(p.name for p in mine.iterdir()) == [".lock", "model.safetensors", "summary.json"]
    assert (mine / "model.safetensors").read_bytes() == b"my own weights"


def test_a_run_that_fails_before_its_first_step_leaves_nothing_behind(cells, tmp_path, capsys):
    new, empty = tmp_path / "new", tmp_path / "empty"
    empty.mkdir()
    for run in (new, empty):
        one_line(capsys, defects(cells, run, "--batch-size", "100000"), "larger than the")
    assert not new.exists() and list(empty.iterdir()) == []
    assert main(defects(cells, new, "--max-steps", "1")) == 0  # the same --run-dir works at once


def test_resume_without_a_checkpoint_starts_at_step_0_and_keeps_one_line_per_step(finished, tmp_path):
    run = copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints")
    for f in ("summary.json", "model.safetensors"):
        (run / f).unlink()
    again = cli(["train", "--resume", str(run)])
    assert again.returncode == 0 and "no checkpoint yet: starting it from step 0" in again.stderr, again.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2]


def test_resume_of_a_finished_run_is_refused(finished, tmp_path, capsys):
    run = copy(finished, tmp_path)
    before = (run / "summary.json").read_bytes()
    one_line(capsys, ["train", "--resume", run], "the run has finished (summary.json); nothing to resume")
    assert (run / "summary.json").read_bytes() == before


# --- 4. Bad input is one line ------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, needle", [
    (["--epochs", "inf"], "--epochs must be a positive finite number"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--seed", "-1"], "--seed must be between 0 and 2**32 - 1"),
    (["--seed", str(2**32)], "--seed must be between 0 and 2**32 - 1"),
    (["--image-size", "8"], "--image-size 8 is below 32"),
    (["--image-size", "100000"], "--image-size 100000 is over the limit"),
    (["--block-size", str(10**9)], "--block-size 1000000000 is over the limit"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive"),
    (["--devices", "0"], "--devices"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (["--data", "/dev/zero"], "not a regular file or directory"),
])
def test_train_flags_out_of_range_are_one_line(cells, tmp_path, capsys, extra, needle):
    one_line(capsys, defects(cells, tmp_path / "run", *extra), needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where, needle", [
    ("/etc/hostname/run", "cannot create the directory"),  # under a file
    ("/proc/gpuwise-run", "cannot create the directory"),
    ("/etc/hostname", "a file of that name exists"),
])
def test_run_dirs_that_cannot_be_are_one_line(cells, capsys, where, needle):
    one_line(capsys, defects(cells, where, "--max-steps", "1"), needle)


@pytest.mark.parametrize("edit, needle", [
    ({"image_size": "big"}, "image_size must be int, not 'big'"),
    ({"workload": "nonsense"}, "unknown workload 'nonsense'"),
    ({"workload": 3}, "workload must be str, not 3"),
    ({"epochs": float("nan")}, "--epochs must be a positive finite number"),
    ({"seed": 2**40}, "--seed must be between"),
    ({"devices": True}, "devices must be int, not True"),
    ({"extra": 1}, "unknown keys: extra"),
])
@pytest.mark.parametrize("command", ["predict", "serve", "export", "resume"])
def test_a_broken_config_yaml_is_one_line(finished, tmp_path, capsys, edit, needle, command):
    run = copy(finished, tmp_path)
    cfg = yaml.safe_load((run / "config.yaml").read_text()) | edit
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    if command == "resume":
        (run / "summary.json").unlink()
        argv = ["train", "--resume", run]
    else:
        argv = {"predict": ["predict", run, "x.png"], "serve": ["serve", run], "export": ["export", run]}[command]
    one_line(capsys, argv, needle)


@pytest.mark.parametrize("damage, needle", [
    (lambda run: (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:100]),
     "cannot load the trained model"),
    (lambda run: (run / "model.safetensors").unlink(), ("cannot load the trained model", "no model.safetensors")),
    (lambda run: (run / "labels.json").write_text("{not json"), "cannot load the trained model"),
    (lambda run: (run / "config.yaml").write_text("[1, 2"), "cannot read"),
    (lambda run: (run / "config.yaml").write_text("- a list"), "does not hold a config mapping"),
    (lambda run: (run / "config.yaml").unlink(), "not a gpuwise run directory"),
    (lambda run: (run / "summary.json").unlink(), "has not finished training"),
])
@pytest.mark.parametrize("command", ["predict", "serve", "export"])
def test_a_damaged_run_is_one_line(finished, tmp_path, capsys, cells, damage, needle, command):
    run = copy(finished, tmp_path)
    damage(run)
    image = next((cells / "defective").iterdir())
    argv = {"predict": ["predict", run, image], "serve": ["serve", run], "export": ["export", run]}[command]
    one_line(capsys, argv, needle)


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for argv in (["predict", tmp_path / "f", "x"], ["serve", tmp_path / "f"], ["export", tmp_path / "f"],
                 ["train", "--resume", tmp_path / "f"]):
        one_line(capsys, argv, ("no such run directory", "is not a gpuwise run directory (a file)"))
