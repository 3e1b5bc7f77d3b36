"""Planner behaviour: layouts, warnings for the classic mistakes, and on-prem cost arithmetic."""

import pytest

from gpuwise.plan.model import resolve_model
from gpuwise.plan.planner import make_plan, plan_one
from gpuwise.plan.request import Layout, PlanRequest


def plan(catalog, model="llama-3.1-8b", **kw):
    return make_plan(resolve_model(model), PlanRequest(**kw), catalog)


def test_tight_fit_warns_about_headroom(catalog):
    # 8B inference in bf16: 16 GB of weights + overhead on a 24 GB card at a long prompt.
    res = plan(catalog, task="inference", gpu="rtx-4090", gpus=1, batch=8, seq=4096, gen=0)
    assert res["fits"]
    assert any("headroom" in w for w in res["warnings"])


def test_batch_that_does_not_fit_says_how_large_one_would(catalog):
    res = plan(catalog, task="finetune", model="qwen2.5-0.5b", gpu="l4", gpus=1, batch=64, seq=2048)
    assert not res["fits"] and res["max_batch"] >= 1
    assert any(f"fits up to micro-batch {res['max_batch']}" in w for w in res["warnings"])


def test_more_gpus_than_a_server_warns(catalog):
    res = plan(catalog, task="finetune", model="llama-3.1-70b", gpu="rtx-4090")
    assert res["gpus"] > 8
    assert any("more than one server holds" in w for w in res["warnings"])


def test_tensor_parallel_over_pcie_warns(catalog):
    res = plan(catalog, task="inference", model="llama-3.1-70b", gpu="l40s", gpus=4, tp=4)
    assert any("tensor parallel over 4 cards (PCIe only" in w for w in res["warnings"])


def test_model_that_fits_no_single_card_warns(catalog):
    res = plan(catalog, task="inference", model="llama-3.1-405b")
    assert any("cannot fit on any single card" in w for w in res["warnings"])
    assert res["fits"] and res["gpus"] > 1


def test_default_efficiency_warns_and_a_given_one_does_not(catalog):
    assert any("default efficiency" in w for w in plan(catalog, gpu="h100-sxm")["warnings"])
    assert not any("default efficiency" in w for w in plan(catalog, gpu="h100-sxm", efficiency=0.4)["warnings"])


def test_bf16_on_a_t4_is_refused_with_the_fix(catalog):
    res = plan(catalog, gpu="t4")
    assert not res["fits"] and "use --precision fp16" in res["why"]
    assert plan(catalog, gpu="t4", precision="fp16", task="qlora")["fits"]


def test_nothing_fits_gives_advice(catalog):
    res = plan(catalog, task="pretrain", model="llama-3.1-405b", seq=131072, batch=8)
    assert not res["fits"]
    assert any("nothing in the catalog fits" in w for w in res["warnings"])


def test_tensor_parallel_divides_weights_and_activations(catalog):
    m, acc = resolve_model("llama-2-70b"), catalog.get("h100-sxm")
    req = PlanRequest(task="inference", seq=1024)
    one = plan_one(m, req, acc, Layout(1), catalog).mem
    four = plan_one(m, req, acc, Layout(4, tp=4), catalog).mem
    assert four.weights == pytest.approx(one.weights / 4)
    assert four.activations == pytest.approx(one.activations / 4)


def test_onprem_cost_and_breakeven_arithmetic(catalog):
    # h100-sxm: Supermicro server 297,000 / 8 GPUs; 4 years at 60 %; 700 W x 1.5 host x 1.4 PUE x 0.15 USD/kWh.
    res = plan(catalog, gpu="h100-sxm", gpus=1, tokens=1e6)
    on = res["onprem"]
    capex = 297_000 / 8 / (4 * 8760 * 0.6)
    power = 0.7 * 1.5 * 1.4 * 0.15
    assert on["usd_per_gpu_hour"] == pytest.approx(capex + power)
    cheapest = min(c["usd_per_gpu_hour"] for c in res["cost"])
    assert on["breakeven_utilization"] == pytest.approx(297_000 / 8 / (4 * 8760 * (cheapest - power)))


def test_provider_filter_keeps_only_that_provider(catalog):
    res = plan(catalog, provider="lambda", task="lora")
    assert {c["provider"] for o in res["options"] for c in o["cost"]} == {"Lambda"}


def test_a_sweep_costs_about_its_accelerators_planned_one_by_one(catalog):
    """Not a benchmark (benchmarks/plan_speed.py is): a guard against an accidental blow-up, relative to one
    accelerator's plan timed here: a sweep is one such plan per accelerator, so it costs about their sum.
    Tolerance: 4 times that sum. Medians of 5, after a warm-up."""
    import statistics
    import time

    kw = {"task": "pretrain", "model": "llama-3.1-405b", "checkpointing": "full"}

    def seconds(**more) -> float:
        plan(catalog, **kw, **more)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan(catalog, **kw, **more)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one, sweep = seconds(gpu="h100-sxm"), seconds()
    n = len(plan(catalog, **kw)["options"])
    assert sweep < 4 * n * one, (sweep, n, one)


def test_fastest_mark_skips_tensor_parallel_over_pcie(catalog):
    res = plan(catalog, task="inference", model="llama-3.1-70b", batch=8, seq=1024)
    fastest = next(o for o in res["options"] if o["fastest"])
    acc = catalog.get(fastest["gpu"])
    assert fastest["layout"]["tp"] <= acc.nvlink_domain
