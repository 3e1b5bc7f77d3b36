"""The run record: every plan, bench and run lands (even two writers at once), compare reports the
estimates' errors, and bench's calibration is what plan and train then use, saying so."""

import json
import os
import subprocess
import sys

from gpuwise.cli import main
from gpuwise.runs import db

from train_data import image_folder


def test_two_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.sqlite"
    code = ("import sys; from gpuwise.runs import db\n"
            "for i in range(150): db.record('plan', 'cpu', f'w{sys.argv[1]}-{i}', {'i': i}, path=sys.argv[2])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(n), str(path)]) for n in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    names = {r["name"] for r in db.rows(path=path)}
    assert len(names) == 300


def test_plan_bench_and_train_are_recorded_and_compared(capsys, tmp_path):
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "--json"]) == 0
    plan_id = json.loads(capsys.readouterr().out)["record_id"]
    cells = image_folder(tmp_path / "cells", per_class=8)
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 2 --run-dir {tmp_path / 'r'}"
    args += " --json"
    assert main(args.split()) == 0
    train = json.loads(capsys.readouterr().out)
    assert main(["runs", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["id"], r["kind"]) for r in listed] == [(plan_id, "plan"), (train["record_id"], "train")]
    assert main(["runs", "show", str(train["record_id"])]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["steps"] == 2
    assert main(["runs", "compare", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    plan, actual = train["plan"], train["actual"]
    assert row["memory_error"] == (plan["peak_bytes"] - actual["peak_bytes"]) / actual["peak_bytes"]
    assert row["step_time_error"] == (plan["step_time_s"] - actual["step_time_s"]) / actual["step_time_s"]
    assert main(["runs", "show", "999"]) == 2


def test_bench_calibration_is_used_by_plan_and_train_and_said(capsys, tmp_path):
    rid = db.record("bench", "cuda:h100-sxm", "bench", {})
    db.calibrate("cuda:h100-sxm", {"matmul.bf16": 0.61}, rid)
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["compute"]["efficiency"] == 0.61
    assert "measured by gpuwise bench on cuda:h100-sxm" in res["compute"]["efficiency_origin"]
    assert not any("default efficiency" in w for w in res["warnings"])

    from gpuwise.train.measure import device_key

    # keyed by precision: a share measured at bf16 plans no fp32 run
    db.calibrate(device_key("cpu"), {"workload.defects@bf16-mixed": 0.33}, rid)
    cells = image_folder(tmp_path / "cells", per_class=8)
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 2 --precision bf16-mixed --json"
    assert main([*args.split(), "--run-dir", str(tmp_path / "r")]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["efficiency"] == 0.33 and plan["efficiency_origin"].startswith("measured by gpuwise bench")
    assert main([*args.replace("bf16-mixed", "32-true").split(), "--run-dir", str(tmp_path / "r2")]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["efficiency"] == 0.462 and "PaLM" in plan["efficiency_origin"]


def test_db_flag_and_unwritable_record(capsys, tmp_path):
    target = tmp_path / "elsewhere.sqlite"
    assert main(["--db", str(target), "plan", "--model", "llama-2-7b", "--gpu", "t4", "--precision", "fp16"]) == 0
    capsys.readouterr()
    assert [r["kind"] for r in db.rows(path=target)] == ["plan"]
    os.environ["GPUWISE_DB"] = "/proc/no-such-dir/runs.sqlite"  # conftest's fixture restores it
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "t4", "--precision", "fp16"]) == 0
    assert "warning: not recorded" in capsys.readouterr().err
