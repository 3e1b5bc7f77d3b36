"""The training loop's promises: resume is exact, 2 processes do the same math as 1, an OOM mid-run
changes nothing, and checkpoints are atomic and checked."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_data import image_folder

GPUWISE = [sys.executable, "-m", "gpuwise"]


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("cells"))


# Another split of the batch (processes, micro-batches) is the same math only in fp32: under bf16 autocast
# (`--precision auto` on a CPU with AMX) each split rounds its matrix products differently (measured: weights
# apart by up to 0.016 after 6 steps), so the invariants are checked in fp32. Resume stays bitwise in bf16.
EXACT = ("--precision", "32-true")


def defects_args(cells, run_dir, *extra):
    return [
        "train",
        "defects",
        "--data",
        str(cells),
        "--image-size",
        "64",
        "--batch-size",
        "8",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def run_cli(args, **kw):
    return subprocess.run(GPUWISE + args, capture_output=True, text=True, **kw)


def small_run(cells, run_dir, **overrides) -> dict:
    """An in-process training run of the defects CNN on the small image folder."""
    from gpuwise.train.config import TrainConfig
    from gpuwise.train.loop import train

    cfg = dict(workload="defects", data=str(cells), image_size=32, batch_size=8, run_dir=str(run_dir)) | overrides
    return train(TrainConfig(**cfg))


def weights(run_dir: Path, file: str = "model.safetensors") -> dict:
    return load_file(str(run_dir / file))


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_training(run_a: Path, run_b: Path, file: str = "model.safetensors") -> None:
    """Same math, other float summation order. Tolerances: the loss trajectories to 2e-3 relative; the
    weights to 1e-3 of the whole model's norm, because Adam divides by sqrt(v): a near-zero gradient
    whose float noise flips sign moves its weight by +-lr, which no element-wise check survives, and
    the next steps' losses inherit a little of it. Weight standardization makes near-zero gradients
    common (a kernel's gradient is projected off its mean and off the kernel itself): 5.3e-4 relative by
    step 4 here, against 4e-5 by step 6 with plain convolutions."""
    torch.testing.assert_close(torch.tensor(losses(run_b)), torch.tensor(losses(run_a)), rtol=2e-3, atol=1e-5)
    a, b = weights(run_a, file), weights(run_b, file)
    assert a.keys() == b.keys()
    diff = sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5
    norm = sum(float(a[k].norm() ** 2) for k in a) ** 0.5
    assert diff <= 1e-3 * norm, (diff, norm)


@pytest.mark.slow
def test_kill_9_then_resume_gives_bitwise_identical_weights(cells, tmp_path):
    args = ("--max-steps", "40", "--checkpoint-every", "4")
    done = run_cli(defects_args(cells, tmp_path / "whole", *args))
    assert done.returncode == 0, done.stderr

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        GPUWISE + defects_args(cells, killed, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step-000008").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its second checkpoint"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "summary.json").exists(), "the run finished before it was killed"

    resumed = run_cli(["train", "--resume", str(killed)])
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))  # the redone steps logged once
    a, b = weights(tmp_path / "whole"), weights(killed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_with_one_line(cells, tmp_path):
    run = tmp_path / "run"
    first = run_cli(defects_args(cells, run, "--max-steps", "8", "--checkpoint-every", "4", "--keep-checkpoints", "5"))
    assert first.returncode == 0, first.stderr
    reference = weights(run)
    newest = run / "checkpoints" / "step-000008" / "state.ckpt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    (run / "model.safetensors").unlink()
    (run / "summary.json").unlink()
    again = run_cli(["train", "--resume", str(run)])
    assert again.returncode == 0, again.stderr
    assert "checkpoint step-000008 is corrupt (state.ckpt fails its checksum); using the one before it" in again.stderr
    b = weights(run)
    assert all(torch.equal(reference[k], b[k]) for k in reference)


def torchrun(args: list[str], port: int) -> None:
    """gpuwise under torchrun with 2 CPU processes (gloo), as a user would launch it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([*launcher, "-m", "gpuwise", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_give_the_same_weights_as_one(cells, tmp_path):
    common = ("--max-steps", "6", "--accelerator", "cpu", *EXACT)
    one = run_cli(defects_args(cells, tmp_path / "one", *common))
    assert one.returncode == 0, one.stderr
    torchrun(defects_args(cells, tmp_path / "two", *common, "--devices", "2"), 29517)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["device"] == "cpu x 2" and summary["strategy"] == "ddp"
    assert_same_training(tmp_path / "one", tmp_path / "two")  # gloo sums in another order


@pytest.mark.slow
def test_two_processes_train_the_members_of_a_multi_cnn_model_then_assemble_them(cells, tmp_path):
    """Every process trains each member in turn, then all read the members' files the first one wrote
    (without a barrier after each member, the second process read a summary.json not yet written)."""
    run = tmp_path / "run"
    torchrun(defects_args(cells, run, "--max-steps", "2", "--image-size", "32", "--model", "multiscale",
                          "--devices", "2"), 29522)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["device"] == "cpu x 2"
    for part in ("cnn-32px-seed0", "cnn-48px-seed0"):
        assert json.loads((run / "parts" / part / "summary.json").read_text())["device"] == "cpu x 2"


@pytest.mark.slow
def test_fsdp_on_two_processes_matches_one_and_resumes_from_its_shards(cells, tmp_path):
    common = ("--max-steps", "6", "--checkpoint-every", "2", "--accelerator", "cpu", *EXACT)
    one = run_cli(defects_args(cells, tmp_path / "one", *common))
    assert one.returncode == 0, one.stderr
    sharded = tmp_path / "fsdp"
    torchrun(defects_args(cells, sharded, *common, "--devices", "2", "--strategy", "fsdp"), 29518)
    assert json.loads((sharded / "summary.json").read_text())["strategy"] == "fsdp"
    assert_same_training(tmp_path / "one", sharded)  # the saved model is whole, gathered from the shards
    assert (sharded / "checkpoints" / "step-000004" / "state.ckpt").is_dir()  # each process wrote its part

    resumed = tmp_path / "resumed"
    shutil.copytree(sharded, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    (resumed / "model.safetensors").unlink()
    (resumed / "summary.json").unlink()
    torchrun(["train", "--resume", str(resumed)], 29519)
    a, b = weights(sharded), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 5-6 redone from step 4's shards: bitwise


@pytest.mark.slow
@pytest.mark.parametrize(
    "workload, data, saved",
    [
        # decoder layers sharded one by one (transformers' _no_split_modules), LoRA beside frozen weights
        ("product-lm", ("--base", "scratch", "--method", "lora", "--block-size", "32"),
         "adapter/adapter_model.safetensors"),
        # embeddings read outside forward (scoring every item) through whole_params; matrix factorization,
        # whose forward draws no dropout masks (the sequential model's: test_fsdp_trains_the_sequential_...)
        ("recommender", ("--model", "mf"), "model.safetensors"),
    ],
)
def test_fsdp_shards_other_models_alike(workload, data, saved, tmp_path):
    from train_data import interactions_csv, reviews_jsonl

    source = reviews_jsonl(tmp_path / "r.jsonl") if workload == "product-lm" else interactions_csv(tmp_path / "i.csv")
    common = [workload, "--data", str(source), "--batch-size", "8", "--max-steps", "3", "--accelerator", "cpu", *EXACT,
              *data]
    one = run_cli(["train", *common, "--run-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    torchrun(["train", *common, "--run-dir", str(tmp_path / "two"), "--devices", "2", "--strategy", "fsdp"], 29520)
    assert_same_training(tmp_path / "one", tmp_path / "two", saved)


@pytest.mark.slow
def test_fsdp_trains_the_sequential_recommender_and_saves_it_whole(tmp_path):
    """The default recommender under FSDP on 2 processes: its dropout masks differ from one process's, so
    the run is not compared number for number; it trains, evaluates (every item's score through
    whole_params) and saves the whole model, which serves recommendations."""
    from train_data import interactions_csv

    data = interactions_csv(tmp_path / "i.csv")
    run = tmp_path / "two"
    torchrun(["train", "recommender", "--data", str(data), "--batch-size", "8", "--max-steps", "3", "--accelerator",
              "cpu", *EXACT, "--run-dir", str(run), "--devices", "2", "--strategy", "fsdp"], 29521)
    one = run_cli(["train", "recommender", "--data", str(data), "--batch-size", "8", "--max-steps", "3",
                   "--accelerator", "cpu", *EXACT, "--run-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    a, b = weights(tmp_path / "one", "model.safetensors"), weights(run, "model.safetensors")
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert all(torch.isfinite(v).all() for v in b.values()) and len(losses(run)) == 3
    done = run_cli(["predict", str(run), "u1", "--k", "3", "--json"])
    assert done.returncode == 0 and json.loads(done.stdout)[0]["source"] == "model", done.stderr


def test_injected_oom_keeps_the_loss_trajectory(cells, tmp_path, monkeypatch):
    clean = small_run(cells, tmp_path / "clean", micro_batch_size=8, max_steps=6, precision="32-true")
    monkeypatch.setenv("GPUWISE_INJECT_OOM", "2")
    hit = small_run(cells, tmp_path / "oom", micro_batch_size=8, max_steps=6, precision="32-true")
    assert hit["oom_events"] == [{"step": 2, "from": 8, "to": 4}]
    assert hit["micro_batch"] == 4 and hit["accumulation"] == 2 and hit["global_batch"] == 8
    assert clean["micro_batch"] == 8
    assert_same_training(tmp_path / "clean", tmp_path / "oom")


def test_checkpoints_are_whole_and_pruned(cells, tmp_path):
    from gpuwise.train import checkpoint

    run = tmp_path / "run"
    small_run(cells, run, max_steps=6, checkpoint_every=1, keep_checkpoints=2)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step-000005", "step-000006"]  # no temp names left, the last two kept
    assert checkpoint.verify(run / "checkpoints" / "step-000006") is None
    for f in ("config.yaml", "metrics.jsonl", "summary.json", "model.safetensors", "labels.json"):
        assert (run / f).is_file(), f
    assert any((run / "tensorboard").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    for key in ("workload", "steps", "final_loss", "eval", "baseline", "throughput", "mfu", "device", "precision",
                "plan", "actual"):
        assert key in summary, key
    assert set(summary["throughput"]) == {"samples_per_s", "tokens_per_s"}
    assert {"peak_bytes", "step_time_s"} <= set(summary["plan"]) & set(summary["actual"])


def test_same_micro_batch_split_gives_same_weights(cells, tmp_path):
    # Gradient accumulation: 8 = 8 x 1 or 2 x 4 is the same step (GroupNorm: no cross-sample statistics).
    for name, micro in (("whole", 8), ("split", 2)):
        small_run(cells, tmp_path / name, micro_batch_size=micro, max_steps=4, precision="32-true")
    assert_same_training(tmp_path / "whole", tmp_path / "split")


def test_sigterm_writes_a_checkpoint_and_says_how_to_resume(cells, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        GPUWISE + defects_args(cells, run, "--max-steps", "100000", "--checkpoint-every", "100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "gpuwise train --resume" in err.splitlines()[-1]
    saved = list((run / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    shutil.rmtree(run)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's VmHWM")
def test_what_runs_paused_is_left_out_of_the_training_peak():
    """An evaluation's batches (SmolLM2's logits alone: 1.6 GB at 8 x 1024 tokens) are not the training
    step's: the peak counts what ran outside `paused()`, not inside."""
    from gpuwise.hardware.cpu import retain_freed_memory
    from gpuwise.train.measure import PeakMemory

    retain_freed_memory()  # as the CLI runs: freed memory kept in the process
    mem = PeakMemory("cpu", 0)
    with mem.paused():
        evaluation = torch.ones(100_000_000)  # 400 MB, touched
        del evaluation
    step = torch.ones(25_000_000)  # 100 MB
    peak = mem.read()
    del step
    assert peak is not None and 90e6 < peak < 250e6


def test_a_bf16_true_run_trains_and_plans(cells, tmp_path):
    """bf16 weights: the planning probe, which runs the unwrapped model, gets its inputs in bf16 as the steps do
    (it crashed on fp32 images against bf16 kernels before)."""
    s = small_run(cells, tmp_path / "r", max_steps=2, precision="bf16-true")
    assert s["precision"] == "bf16-true" and s["plan"]["peak_bytes"] > 0 and len(losses(tmp_path / "r")) == 2
