"""The typed results (gpuwise.results): a real plan, training summary and bench go through the models and come
out as the same JSON, key for key and in order; records older gpuwise versions wrote still load and render; the
published schemas in docs/schema/ are what `gpuwise schema` prints."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from gpuwise.cli import main
from gpuwise.plan.model import resolve_model
from gpuwise.plan.planner import build_plan, make_plan
from gpuwise.plan.request import PlanRequest
from gpuwise.results import BenchResult, PlanResult, TrainSummary
from gpuwise.runs import db

from train_data import image_folder

DOCS = Path(__file__).resolve().parent.parent / "docs" / "schema"

PLAN_KEYS = ["model", "task", "gpu", "gpu_name", "gpus", "layout", "precision", "batch", "seq", "memory", "capacity",
             "fits", "why", "max_batch", "kv_cache_per_token", "trainable_params", "compute", "cost", "onprem",
             "warnings", "recommended", "assumptions", "options"]
SUMMARY_KEYS = ["workload", "run_dir", "steps", "epochs", "final_loss", "eval", "baseline", "throughput", "mfu",
                "peak_flops", "flops_per_step", "device", "precision", "strategy", "global_batch", "micro_batch",
                "accumulation", "oom_events", "plan", "actual", "estimate_error", "data", "files", "wall_s",
                "projection", "utilization", "record_id"]

# A bench as bench.json holds it: a CPU with its projections, and a GPU (host_device, no projections).
BENCH = {
    "size": "quick", "torch": "2.13.0+cpu", "threads": 2,
    "devices": {
        "cpu": {
            "key": "cpu:AMD EPYC",
            "peak": {"name": "AMD EPYC", "fp32_tflops": 0.156505984, "tf32_tflops": None, "bf16_tflops": None,
                     "fp16_tflops": None, "bandwidth_gbs": None, "origin": "2 cores x 32 FP32 FLOP/cycle",
                     "bandwidth_origin": "a CPU's memory-bandwidth peak is not detectable from inside a machine"},
            "matmul": {"fp32": {"tflops": 0.0709, "n": 1024, "seconds": 0.0302, "fraction_of_peak": 0.453}},
            "workloads": {
                "defects": {"samples_per_s": 106.3, "step_s": 0.30, "flops_per_step": 18538872832.0,
                            "precision": "32-true", "batch": 32, "params": 398369, "tflops": 0.0616,
                            "fraction_of_peak": 0.393},
                "recommender": {"samples_per_s": 137426.0, "step_s": 0.0074, "flops_per_step": 0.0,
                                "precision": "32-true", "batch": 1024, "params": 632234, "tflops": 0.0,
                                "s_per_sample": 1.0e-06, "s_per_param": 1.0e-08, "fraction_of_peak": None},
                "product-lm": {"samples_per_s": 19.8, "step_s": 0.40, "flops_per_step": 27380416512.0,
                               "precision": "32-true", "batch": 8, "params": 4458752, "tflops": 0.0678,
                               "tokens_per_s": 2538.0, "fraction_of_peak": 0.433},
            },
            "bandwidth": {"copy_gbs": 18.4, "triad_gbs": 21.3, "bytes": 67108864, "fraction_of_peak": None},
        },
        "cuda:0": {
            "key": "cuda:h100-sxm",
            "peak": {"name": "NVIDIA H100 80GB HBM3", "slug": "h100-sxm", "fp32_tflops": 67.0, "tf32_tflops": 494.7,
                     "bf16_tflops": 989.4, "fp16_tflops": 989.4, "bandwidth_gbs": 3350, "origin": "catalog h100-sxm",
                     "interconnect": "PCIe Gen5 x16, NVLink 4"},
            "matmul": {"bf16": {"tflops": 700.0, "n": 4096, "seconds": 0.0002, "fraction_of_peak": 0.707}},
            "workloads": {},
            "bandwidth": {"copy_gbs": 2900.0, "triad_gbs": 3000.0, "bytes": 268435456, "fraction_of_peak": 0.89},
            "host_device": {"h2d_gbs": 50.0, "d2h_gbs": 49.0, "bytes": 67108864, "fraction_of_peak": 0.79,
                            "peak_origin": "PCIe 5 x16 line rate, one direction"},
        },
    },
    "projections": {
        "l4": {"peak": {"name": "NVIDIA L4", "slug": "l4", "origin": "catalog l4"}, "projected": True,
               "matmul": {"fp32": {"tflops": 24.3, "basis": "dense peak x 0.80"}},
               "workloads": {"defects": {"samples_per_s": 900.0, "basis": "Lambda"}},
               "bandwidth": {"triad_gbs": 300.0, "basis": "catalog peak (an upper bound)"}},
    },
    "speedup": {"l4 (projected)": {"matmul fp32": 343.4, "bandwidth (triad)": 14}},
    "files": {"json": "runs/bench/bench.json", "png": "runs/bench/bench.png"},
    "record_id": 3,
}


def same_json(a, b) -> bool:
    """Equal as JSON text: the same keys in the same order, and 2 is not 2.0."""
    return json.dumps(a) == json.dumps(b)


@pytest.mark.parametrize("model,kw", [
    ("llama-3.1-8b", {"task": "qlora"}),
    ("llama-3.1-70b", {"task": "inference", "gpu": "h100-sxm", "batch": 8, "seq": 1024}),
    ("llama-3.1-405b", {"task": "pretrain", "checkpointing": "full"}),
    ("llama-3.1-8b", {"gpu": "t4"}),
])
def test_plan_round_trips_as_the_same_json(catalog, model, kw):
    result = build_plan(resolve_model(model), PlanRequest(**kw), catalog)
    assert isinstance(result, PlanResult)
    data = make_plan(resolve_model(model), PlanRequest(**kw), catalog)
    assert list(data) == PLAN_KEYS
    assert same_json(result.dump(), data)
    assert same_json(PlanResult.load(json.loads(json.dumps(data))).dump(), data)
    if kw.get("task") == "pretrain":  # 20 tokens per parameter: an int, and it stays one
        assert isinstance(data["compute"]["tokens"], int)


def test_plan_json_and_record_keep_their_keys(capsys):
    assert main(["plan", "--model", "llama-2-7b", "--gpu", "h100-sxm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == PLAN_KEYS + ["serving", "record_id"]  # serving: an inference plan's (the default task)
    [row] = db.rows("plan")
    assert same_json(PlanResult.load(row["data"]).dump(), row["data"])


def test_train_summary_round_trips_and_renders(capsys, tmp_path):
    cells = image_folder(tmp_path / "cells", per_class=8)
    run = tmp_path / "run"
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 2 --run-dir {run} --json"
    assert main(args.split()) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((run / "summary.json").read_text())
    assert list(written) == SUMMARY_KEYS
    assert same_json(printed, written)
    summary = TrainSummary.load(written)
    assert same_json(summary.dump(), written)
    assert summary.steps == 2 and summary.actual.peak_bytes == written["actual"]["peak_bytes"]
    assert summary.baseline.name == "majority class" and summary.published["accuracy@0.5"] == 0.8842
    # the record holds the same summary, less the id it was given
    [row] = db.rows("train")
    assert same_json(row["data"], {k: v for k, v in written.items() if k != "record_id"})


def test_bench_round_trips_as_the_same_json(tmp_path):
    result = BenchResult.load(BENCH)
    assert same_json(result.dump(), BENCH)
    assert result.devices["cuda:0"].host_device.h2d_gbs == 50.0
    assert result.devices["cpu"].host_device is None and "host_device" not in result.dump()["devices"]["cpu"]
    assert result.files.json_path == "runs/bench/bench.json"
    from gpuwise.cli.bench import render

    con = Console(file=io.StringIO(), width=150)
    render(con, BENCH)
    text = con.file.getvalue()
    assert "host -> device" in text and "l4 (projected) vs cpu" in text and "projected, not measured" in text
    assert "*" not in text and "above 100 %" not in text
    # a CPU whose boost runs above the clock it reports: the share is starred, and the note says why
    boosted = json.loads(json.dumps(BENCH))
    boosted["devices"]["cpu"]["matmul"]["fp32"]["fraction_of_peak"] = 1.41
    con = Console(file=io.StringIO(), width=200)
    render(con, boosted)
    text = con.file.getvalue()
    assert "141%*" in text and "* above 100 %: the device ran faster than the clock its peak counts" in text


@pytest.mark.parametrize("kind", ["plan", "traced", "train", "bench"])
def test_schema_command_prints_the_published_schema(capsys, kind):
    assert main(["schema", kind]) == 0
    out = capsys.readouterr().out
    assert out == (DOCS / f"{kind}.json").read_text(encoding="utf-8"), f"regenerate: gpuwise schema {kind}"
    schema = json.loads(out)
    assert schema["type"] == "object" and schema["properties"]


def test_schema_describes_every_field():
    from gpuwise.results import SCHEMAS

    for model in SCHEMAS.values():
        for name, spec in model.model_json_schema()["$defs"].items():
            for field, prop in spec.get("properties", {}).items():
                assert prop.get("description"), f"{name}.{field} has no description"


def test_schema_refuses_an_unknown_kind(capsys):
    assert main(["schema", "nope"]) == 2
    assert "plan" in capsys.readouterr().err


# --- records written by older gpuwise versions --------------------------------------------------------------

OLD_SUMMARY = {  # no strategy, projection, estimate_error, record_id; a plan without efficiency; an OOM
    "workload": "recommender", "run_dir": "runs/recommender-1", "steps": 40, "epochs": 2.0, "final_loss": 0.31,
    "eval": {"ndcg@10": 0.12, "recall@10": 0.2, "users": 40},
    "baseline": {"name": "popularity", "ndcg@10": 0.1, "recall@10": 0.15,
                 "also": {"ItemKNN (cosine)": {"ndcg@10": 0.11, "recall@10": 0.18}}},
    "throughput": {"samples_per_s": 5000.0, "tokens_per_s": None}, "mfu": None,
    "peak_flops": {"per_device": None, "origin": "no peak"}, "flops_per_step": 0.0,
    "device": "cpu x 1", "precision": "32-true", "global_batch": 1024, "micro_batch": 512, "accumulation": 2,
    "oom_events": [{"step": 3, "from": 1024, "to": 512}],
    "plan": {"peak_bytes": 1000000, "step_time_s": None, "method": "model states"},
    "actual": {"peak_bytes": 2000000, "step_time_s": 0.01, "method": "VmHWM"},
    "data": {"data": "MovieLens", "users": 40}, "files": ["model.safetensors"], "wall_s": 1.5,
}


def test_an_old_summary_loads_round_trips_and_renders():
    summary = TrainSummary.load(OLD_SUMMARY)
    assert same_json(summary.dump(), OLD_SUMMARY)
    assert summary.strategy is None and summary.projection == [] and summary.record_id is None
    assert summary.oom_events[0].from_ == 1024 and summary.baseline.also["ItemKNN (cosine)"]["ndcg@10"] == 0.11
    from gpuwise.train.report import render

    con = Console(file=io.StringIO(), width=150)
    render(con, OLD_SUMMARY)
    text = con.file.getvalue()
    assert "ItemKNN (cosine)" in text and "micro-batch 1024 -> 512" in text and "MFU n/a" in text


def test_an_old_run_directory_still_gets_its_report(tmp_path):
    from gpuwise.report.html import run_report

    run = tmp_path / "old"
    run.mkdir()
    minimal = {k: OLD_SUMMARY[k] for k in ("workload", "run_dir", "steps", "epochs", "eval", "device", "precision",
                                           "global_batch", "micro_batch", "accumulation")}
    (run / "summary.json").write_text(json.dumps(minimal))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": 0.1,
                                                           "samples_per_s": 10.0}) + "\n" for s in (1, 2, 3)))
    page = run_report(run)
    assert "Quality on held-out data" in page and "ndcg@10" in page and "<h2>Training</h2>" in page


def test_a_damaged_summary_is_one_line_naming_the_field(capsys, tmp_path):
    run = tmp_path / "bad"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({**OLD_SUMMARY, "steps": "many"}))
    (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'steps'" in err and "not what gpuwise train writes" in err


def test_old_and_odd_records_list_and_compare(capsys):
    db.record("train", "cpu:x", "recommender", OLD_SUMMARY)
    db.record("plan", "h100-sxm", "tiny", {"traced": True, "model": {"name": "tiny"}, "gpu": "h100-sxm", "gpus": 1,
                                           "fits": True, "memory": {"total": 1}, "compute": {"step_time_s": 0.1}})
    db.record("bench", "cuda:h100-sxm", "bench", {})  # damaged: no devices
    assert main(["runs"]) == 0
    out = capsys.readouterr().out
    # a result beside its baseline, and the training's wall time
    assert "40 steps, ndcg@10 0.12 (popularity 0.1), 2 s" in out
    assert "1 x h100-sxm, fits True, traced" in out and "damaged" in out
    assert main(["runs", "compare", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["memory_error"] == -0.5 and row["step_time_error"] is None and row["step_time_basis"] is None
    assert main(["runs", "show", "3"]) == 0  # the record as stored, damaged or not
    assert json.loads(capsys.readouterr().out)["data"] == {}
    # a plan says its task: a QLoRA plan and an inference plan do not read alike
    assert main(["plan", "--model", "llama-2-7b", "--task", "qlora"]) == 0
    assert main(["plan", "--model", "llama-2-7b", "--task", "inference"]) == 0
    capsys.readouterr()
    assert main(["runs"]) == 0
    out = capsys.readouterr().out
    assert "qlora: 1 x " in out and "inference: 1 x " in out


def test_a_producer_cannot_add_a_key_no_model_declares(catalog):
    # Readers ignore unknown keys (a newer gpuwise's record); producers may not: the key would vanish unseen.
    data = make_plan(resolve_model("llama-3.1-8b"), PlanRequest(task="qlora", gpu="l4"), catalog)
    data["options"][0]["compute"]["new_figure"] = 1.0
    assert PlanResult.load(data).options[0].compute is not None
    with pytest.raises(ValueError, match="'new_figure' is not a declared field of ComputeEstimate"):
        PlanResult.build(data)
    with pytest.raises(ValueError, match="'extra' is not a declared field of TrainSummary"):
        TrainSummary.build({**OLD_SUMMARY, "extra": 1})


def test_the_summary_says_when_the_step_time_plan_is_uncalibrated():
    """A CPU run planned at the published GPU efficiency says so and how to calibrate; a calibrated one does not."""
    from gpuwise.plan.request import EFFICIENCY
    from gpuwise.train.report import render

    def text(origin: str) -> str:
        plan = {**OLD_SUMMARY["plan"], "step_time_s": 0.001, "efficiency": 0.462, "efficiency_origin": origin}
        con = Console(file=io.StringIO(), width=150)
        render(con, {**OLD_SUMMARY, "plan": plan})
        return con.file.getvalue()

    assert "not calibrated on this CPU at 32-true; `gpuwise bench --quick --precision 32-true` calibrates it" in text(
        EFFICIENCY.origin
    )
    assert "not calibrated" not in text("measured by gpuwise bench on cpu:X (workload.recommender, record #1)")
