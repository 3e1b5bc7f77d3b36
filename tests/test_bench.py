"""`gpuwise bench`: the JSON shape of the issue, the chart, projections marked, bad devices refused."""

import json

import pytest

from gpuwise.cli import main


@pytest.mark.slow
def test_quick_cpu_bench_json_and_chart(capsys, tmp_path):
    assert main(["bench", "--device", "cpu", "--quick", "--out", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    cpu = res["devices"]["cpu"]
    assert {"fp32_tflops", "bf16_tflops", "origin"} <= set(cpu["peak"])
    assert {"tflops", "fraction_of_peak"} <= set(cpu["matmul"]["fp32"])
    assert {"copy_gbs", "triad_gbs", "fraction_of_peak"} <= set(cpu["bandwidth"])
    assert set(cpu["workloads"]) == {"defects", "recommender", "product-lm"}
    assert all(w["samples_per_s"] > 0 for w in cpu["workloads"].values())
    assert cpu["workloads"]["product-lm"]["tokens_per_s"] > 0
    # each step with counted FLOPs timed at a second batch: seconds per step and a share of peak beyond it
    assert all(w["s_per_step"] > 0 and 0 < w["flop_fraction"] < 1 for w in cpu["workloads"].values())
    # No GPU here: the GPU side is projected, labelled so, and never under "devices".
    assert all(p["projected"] for p in res["projections"].values())
    assert all("(projected)" in k for k in res["speedup"])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench.json").read_text())["devices"].keys() == res["devices"].keys()
    # ... recorded, and its report draws the same bars
    page = tmp_path / "bench.html"
    assert main(["report", "--bench", str(res["record_id"]), "--out", str(page)]) == 0
    assert page.read_text().count("data:image/png;base64,") == 1
    capsys.readouterr()
    assert main(["report", "--bench", str(res["record_id"]), "--out", str(page), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert ["cpu", "matmul fp32"] in [r[:2] for r in rows]


@pytest.mark.parametrize("device,needle", [("cuda:7", "no such CUDA device"), ("tpu", "must be cpu, cuda:N or all")])
def test_bad_device_is_one_line(capsys, device, needle):
    assert main(["bench", "--device", device]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_two_batch_sizes_split_the_step_into_a_part_per_step_and_a_part_per_flop():
    """A step of 10 ms plus 1 TFLOP at 40 % of a 10 TFLOP/s peak: timed at 4e10 and 1e10 FLOPs, the split
    gives back the 10 ms and the 40 % exactly, and a plan at 2e10 FLOPs adds them up."""
    from gpuwise.bench.run import per_step_split
    from gpuwise.train.measure import planned_step_time

    def step(flops):
        return {"flops_per_step": flops, "step_s": 0.010 + flops / (10e12 * 0.4), "batch": int(flops / 1e9)}

    split = per_step_split(step(4e10), step(1e10), 10.0)
    assert split["s_per_step"] == pytest.approx(0.010) and split["flop_fraction"] == pytest.approx(0.4)
    planned = split["s_per_step"] + planned_step_time(2e10, 10e12, 1, split["flop_fraction"])
    assert planned == pytest.approx(step(2e10)["step_s"])
    # no usable line: the larger batch faster, or a negative part per step; no peak to share
    assert per_step_split(step(4e10) | {"step_s": 0.001}, step(1e10), 10.0) == {}
    assert per_step_split(step(4e10) | {"step_s": 0.01}, step(1e10) | {"step_s": 0.0}, 10.0) == {}
    assert per_step_split(step(4e10), step(1e10), None) == {}


def test_bench_precision_calibrates_that_precision(capsys, tmp_path, monkeypatch):
    """`--precision 32-true` times the steps in fp32 and stores them under that precision, which an fp32 run
    then plans with; a precision bench cannot time is refused in one line."""
    from gpuwise.runs import db
    from gpuwise.train.measure import device_key, step_efficiency

    monkeypatch.setenv("GPUWISE_DB", str(tmp_path / "runs.sqlite"))
    args = ["bench", "--device", "cpu", "--quick", "--workload", "defects", "--out", str(tmp_path / "b"), "--json"]
    assert main([*args, "--precision", "32-true"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"]["cpu"]["workloads"]["defects"]["precision"] == "32-true"
    assert db.calibration(device_key("cpu"), "workload.defects@32-true") is not None
    # what an fp32 run then plans with (the per-step split where its two batches gave a usable line: in fp32
    # the part per step is near 0 here, and its sign is the VM's noise; else the one share of peak)
    assert step_efficiency(device_key("cpu"), "defects", "32-true")[1].startswith("measured by gpuwise bench")
    assert db.calibration(device_key("cpu"), "workload.defects@bf16-mixed") is None
    assert main([*args, "--precision", "bf16-true"]) == 2
    assert "--precision bf16-true: must be one of auto, 32-true, bf16-mixed" in capsys.readouterr().err
