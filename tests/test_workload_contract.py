"""Issue #10: one workload contract. Nothing outside gpuwise/workloads names a workload, and a fourth
workload defined in tests/ (tiny_workload.py, one file) lives its whole life from the CLI: found through
a `gpuwise.workloads` entry point or as package.module:Class, trained, resumed bitwise, predicted,
benched, traced, served and exported."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuwise"
TESTS = Path(__file__).resolve().parent
BUILTIN = ("defects", "recommender", "product-lm", "product_lm")


def test_no_module_outside_workloads_names_a_workload():
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, BUILTIN)) + r")\b")
    hits = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if "workloads" not in path.relative_to(SRC).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "workload names outside gpuwise/workloads:\n" + "\n".join(hits)


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """An installed package's metadata declaring the entry point, as `pip install` would write it."""
    site = tmp_path_factory.mktemp("site")
    info = site / "tiny_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gpuwise.workloads]\ntiny = tiny_workload:Tiny\n")
    return os.pathsep.join([str(site), str(TESTS)])


def gpuwise(plugin_path: str, tmp: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=plugin_path, GPUWISE_DB=str(tmp / "runs.sqlite"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "gpuwise", *args], capture_output=True, text=True, env=env)
    assert done.returncode == code, (args, done.stdout[-1500:], done.stderr[-1500:])
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_fourth_workload_lives_its_whole_life_from_the_cli(plugin_path, tmp_path):
    run = tmp_path / "run"
    common = ("--max-steps", "6", "--checkpoint-every", "2", "--accelerator", "cpu")
    listed = gpuwise(plugin_path, tmp_path, "train", "--help").stdout
    assert "tiny (plugin)" in listed

    # train through the entry point's name, then resume a copy from step 4: bitwise the same weights
    summary = json.loads(
        gpuwise(plugin_path, tmp_path, "train", "tiny", *common, "--run-dir", str(run), "--json").stdout
    )
    assert summary["workload"] == "tiny" and summary["steps"] == 6 and summary["eval"]["accuracy"] > 0.5
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    for f in ("model.safetensors", "summary.json"):
        (resumed / f).unlink()
    assert "resuming" in gpuwise(plugin_path, tmp_path, "train", "--resume", str(resumed)).stderr
    a, b = load_file(run / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    # the same class as package.module:Class, with no entry point
    by_path = tmp_path / "by-path"
    direct = str(TESTS)
    gpuwise(direct, tmp_path, "train", "tiny_workload:Tiny", "--max-steps", "2", "--run-dir", str(by_path))
    assert (by_path / "summary.json").is_file()

    point = ",".join(["1"] * 4 + ["-1"] * 4)  # below the plane: the weights fall from -1 to 1
    (answer,) = json.loads(gpuwise(plugin_path, tmp_path, "predict", str(run), point, "--json").stdout)
    assert answer["above"] is False and 0 <= answer["probability"] < 0.5
    assert "comma-separated numbers" in gpuwise(plugin_path, tmp_path, "predict", str(run), "a,b", code=2).stderr

    bench = json.loads(
        gpuwise(
            plugin_path, tmp_path, "bench", "--quick", "--workload", "tiny", "--out", str(tmp_path / "b"), "--json"
        ).stdout
    )
    assert json.dumps(bench).count('"tiny"') >= 1
    traced = json.loads(gpuwise(plugin_path, tmp_path, "plan", "--workload", "tiny", "--traced", "--json").stdout)
    assert traced  # the step traced on fake tensors: memory and FLOPs of the probe

    exported = json.loads(gpuwise(plugin_path, tmp_path, "export", str(run), "--json").stdout)
    assert exported["max_abs_diff"] < 1e-5 and exported["inputs_from"] == "synthetic test points"

    port = free_port()
    env = dict(os.environ, PYTHONPATH=plugin_path, OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "gpuwise", "serve", str(run), "--port", str(port), "--runtime", "onnx"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        got = httpx.post(url + "/v1/score", json={"points": [[1.0] * 4 + [-1.0] * 4, [-1.0] * 4 + [1.0] * 4]})
        assert got.status_code == 200, got.text
        assert got.json()["above"] == [False, True]
        assert httpx.post(url + "/v1/score", json={"points": [[1.0]]}).status_code == 422
        assert httpx.get(url + "/v1/info").json()["workload"] == "tiny"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def test_a_run_directory_cannot_name_a_module_inside_itself(tmp_path):
    from gpuwise.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "planted.py").write_text("raise SystemExit('planted code ran')\n")
    (run / "config.yaml").write_text("workload: planted:Evil\n")
    (run / "summary.json").write_text("{}")
    sys.path.insert(0, str(run))
    try:
        assert main(["predict", str(run), "x"]) == 2
    finally:
        sys.path.remove(str(run))
