"""benchmarks/gpu_truth.sh, prepared on the CPU for the day a GPU is lent: its dry run (arguments, every step,
the JSON's shape) and its readers over the real outputs of the commands it runs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwise.cli import main

from train_data import image_folder

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "devices",
    "bench",
    "gpu tests",
    "train defects",
    "train recommender",
    "train product-lm",
    "llm endpoint",
    "serving capacity",
]


@pytest.fixture(scope="module")
def truth():
    spec = importlib.util.spec_from_file_location("gpu_truth", ROOT / "benchmarks" / "gpu_truth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_truth"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_lists_every_step_and_writes_the_json_shape(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_truth.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu_truth.json").read_text())
    assert report["dry_run"] is True and report["schema"] == 1 and list(report["steps"]) == STEPS
    for name, step in report["steps"].items():
        assert step["status"] == "dry-run" and step["figures"] is None and step["timeout_s"] > 0, name
        assert step["command"] in done.stdout
    # every step bounded, and all of them within the 8 minutes the issue allows
    assert sum(s["timeout_s"] for s in report["steps"].values()) > report["budget_s"] and report["budget_s"] <= 450


def test_only_runs_the_steps_named(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_truth.py"), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run([*cmd, "--only", "serving capacity"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "gpu_truth.json").read_text())
    assert list(report["steps"]) == ["serving capacity"]
    assert "benchmarks/capacity_vs_actual.py" in report["steps"]["serving capacity"]["command"]
    done = subprocess.run([*cmd, "--only", "serving"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--only serving: no such step" in done.stderr


def test_bad_arguments_are_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_truth.py"), "--budget", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--budget must be at least 1" in done.stderr


def test_the_readers_take_what_the_commands_print(truth, capsys, tmp_path):
    """Each reader over the real output of its command on this CPU: a 2-step train, a one-workload bench,
    the GPU tests' junit XML (all skipped here), then the table over all of them."""
    cells = image_folder(tmp_path / "cells", per_class=8, size=32)
    args = (
        f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 2 --run-dir {tmp_path / 'r'} --json"
    )
    assert main(args.split()) == 0
    run = truth.figures_train(capsys.readouterr().out)
    assert (
        run["device"].startswith("cpu")
        and run["steps"] == 2
        and run["plan_peak_bytes"] > 0
        and run["actual_step_s"] > 0
    )
    bench_args = ["bench", "--device", "cpu", "--quick", "--workload", "recommender", "--out", str(tmp_path / "b")]
    assert main([*bench_args, "--json"]) == 0
    bench = truth.figures_bench(capsys.readouterr().out)
    assert bench["cpu"]["matmul"]["fp32"]["tflops"] > 0 and bench["cpu"]["bandwidth_gbs"] > 0
    xml = tmp_path / "gpu.xml"
    subprocess.run(truth.gpu_tests(xml), capture_output=True, cwd=ROOT)
    tests = truth.figures_gpu_tests(xml)
    assert tests["tests"] >= 2 and tests["skipped"] == tests["tests"] and tests["failed"] == []
    # capacity_vs_actual.py's --out, in the shape its run_engine returns (its run takes minutes: not here)
    rows = [{"rate": r, "plan": {"throughput": p, "tpot_p50": 0.01}, "measured": {"throughput": m, "tpot_p50": 0.011}}
            for r, p, m in ((20.0, 105.0, 100.0), (36.0, 180.0, 200.0))]  # fmt: skip
    shape = [{"engine": "vllm", "fit": {}, "planned_knee": 40.0, "measured_knee": None, "rows": rows}]
    (tmp_path / "capacity.json").write_text(json.dumps(shape))
    capacity = truth.figures_capacity(tmp_path / "capacity.json")
    assert capacity["vllm"]["rows"][0]["throughput"] == [105.0, 100.0]
    report = {
        "steps": {
            "bench": {"status": "ok", "seconds": 9.0, "figures": bench},
            "gpu tests": {"status": "ok", "seconds": 3.0, "figures": tests},
            "train defects": {"status": "ok", "seconds": 5.0, "figures": run},
            "llm endpoint": {"status": "skipped", "why": "10 s of the budget left, the step needs 90"},
            "serving capacity": {"status": "ok", "seconds": 200.0, "figures": capacity},
        }
    }
    table = truth.table(report)
    assert "vllm: knee planned 40.0/s, measured not crossed, throughput +5% -10%" in table
    assert "fp32" in table and "TFLOP/s" in table and "cpu" in table and "the step needs 90" in table
