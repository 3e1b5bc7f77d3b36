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
    # No GPU here: the GPU side is projected, labelled so, and never under "devices".
    assert all(p["projected"] for p in res["projections"].values())
    assert all("(projected)" in k for k in res["speedup"])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench.json").read_text())["devices"].keys() == res["devices"].keys()
    # ... recorded, and its report draws the same bars
    page = tmp_path / "bench.html"
    assert main(["report", "--bench", str(res["record_id"]), "--out", str(page)]) == 0
    assert page.read_text().count("data:image/png;base64,") == 1


@pytest.mark.parametrize("device,needle", [("cuda:7", "no such CUDA device"), ("tpu", "must be cpu, cuda:N or all")])
def test_bad_device_is_one_line(capsys, device, needle):
    assert main(["bench", "--device", device]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
