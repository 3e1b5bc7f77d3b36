"""Issue #53, item 1 and the fleet's arithmetic: a run's devices sampled while it runs (hardware/usage.py), and
the figures `gpuwise fleet` makes of uses (fleet/report.py), checked against sacct's own text and the plan's
TCO formula. The services themselves (Slurm's accounting, Ray, PostgreSQL) are in test_fleet.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwise.fleet.report import idle_now, idlest, own_or_rent, parse_prices, summarize
from gpuwise.fleet.sources import Use, parse_sacct
from gpuwise.hardware.usage import IDLE_BELOW, Sampler, cpu_probe, nvml_probe, probe_for
from gpuwise.plan.cost import onprem_cost
from gpuwise.plan.request import PlanRequest

TESTS = Path(__file__).resolve().parent
GPUWISE = Path(sys.executable).parent / "gpuwise"


def test_without_nvml_a_cuda_run_says_so_in_one_line_and_samples_its_cpu():
    """No GPU here: nvidia-ml-py is installed (a dependency) but its library finds no driver."""
    import pynvml  # noqa: F401 - the package is there; the driver is not

    assert nvml_probe() is None
    probe, note = probe_for("cuda")
    assert probe.kind == "cpu (process)" and note and "\n" not in note and "NVML is not available" in note
    assert probe_for("cpu")[1] is None


def test_the_cpu_probe_tells_a_busy_process_from_an_idle_one():
    """Relative, not absolute: a spin of one thread is at least 5 times the share of a sleep, on any host."""
    sampler = Sampler(cpu_probe(), interval=60)  # sampled by hand below
    sampler.sample()
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        pass
    busy = sampler.sample()
    time.sleep(0.6)
    idle = sampler.sample()
    assert busy is not None and idle is not None
    assert busy.utilization > 5 * idle.utilization and idle.utilization < IDLE_BELOW
    summary = sampler.stop()
    assert summary["samples"] == 4 and summary["idle_share"] >= 0.25 and summary["peak_memory_bytes"] > 0
    assert 0 < summary["peak_memory_share"] < 1 and summary["running"] is False


def test_a_training_run_keeps_its_use_in_its_summary_and_record(tmp_path):
    done = subprocess.run([str(GPUWISE), "train", "tiny_workload:Tiny", "--max-steps", "3", "--accelerator", "cpu",
                           "--run-dir", str(tmp_path / "run"), "--json"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(TESTS), "GPUWISE_USAGE_INTERVAL_S": "0.2",
                               "GPUWISE_TEAM": "team-x"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    used = json.loads(done.stdout)["utilization"]
    assert used["kind"] == "cpu (process)" and used["samples"] >= 1 and 0 <= used["mean"] <= 1
    assert used["count"] >= 1 and used["running"] is False
    kept = json.loads((tmp_path / "run" / "usage.json").read_text())  # what fleet reads of a run still going
    assert kept["samples"] == used["samples"] and kept["running"] is False


SACCT = """\
11|gpuwise-train|team-a|alice|COMPLETED|125|billing=2,cpu=2,gres/gpu:h100-sxm=2,gres/gpu=2,mem=4G,node=1|\
2026-12-06T01:00:00|2026-12-06T01:02:05|debug
12|notebook|team-b|bob|RUNNING|3600|cpu=1,gres/gpu=1,mem=1G,node=1|2026-12-06T00:00:00|Unknown|debug
13|prep|team-b|bob|CANCELLED by 0|30|cpu=4,mem=1G,node=1|2026-12-06T02:00:00|2026-12-06T02:00:30|debug
14|queued|team-a|alice|PENDING|0|billing=1|Unknown|Unknown|debug
"""


def test_sacct_lines_become_uses_with_its_own_seconds():
    uses = {u.job: u for u in parse_sacct(SACCT, now=time.time())}
    assert set(uses) == {"11", "12", "13"}  # a pending job holds nothing yet
    a, b, c = uses["11"], uses["12"], uses["13"]
    assert (a.gpu, a.devices, a.team, a.user, a.seconds(0)) == ("h100-sxm", 2, "team-a", "alice", 125)
    assert b.running and b.gpu == "gpu" and b.devices == 1
    assert (c.gpu, c.devices, c.state, c.seconds(0)) == ("cpu", 4, "CANCELLED", 30)


def use(job: str, team: str, gpu: str, devices: float, start: float, end: float | None, util=None, idle=None,
        tail=None) -> Use:  # fmt: skip
    return Use("slurm", job, job, "u", team, job, "slurm", gpu, devices, start, end, "X", util, idle, tail)


def test_groups_count_hours_busy_only_where_measured_and_price_by_the_sites_own(catalog):
    now = 10_000.0
    uses = [use("a", "t1", "h100-sxm", 2, 0, 3600, util=0.5, idle=0.25), use("b", "t1", "h100-sxm", 1, 0, 7200),
            use("c", "t2", "cpu", 8, 0, 1800, util=0.1, idle=0.9)]  # fmt: skip
    prices = parse_prices(["h100-sxm=2", "cpu=0.05"])
    rows = {r["team"]: r for r in summarize(uses, "team", now, catalog, prices)}
    t1 = rows["t1"]
    assert t1["jobs"] == 2 and t1["gpu_hours"] == pytest.approx(4.0) and t1["measured_hours"] == pytest.approx(2.0)
    assert t1["busy_hours"] == pytest.approx(1.0) and t1["utilization"] == pytest.approx(0.5)
    assert t1["idle_share"] == pytest.approx(0.25) and t1["usd"] == pytest.approx(8.0)
    assert rows["t2"]["cpu_core_hours"] == pytest.approx(4.0) and rows["t2"]["usd"] == pytest.approx(0.2)
    catalog_priced = summarize(uses[:1], "gpu", now, catalog, {})[0]
    cheapest = min(p.usd_per_gpu_hour for p in catalog.prices("h100-sxm"))
    assert catalog_priced["usd"] == pytest.approx(2 * cheapest) and "(catalog)" in catalog_priced["price_sources"][0]
    assert [j["job"] for j in idlest(uses, now)] == ["c", "a"]  # 3.6 idle core-hours, then 0.5 GPU-hours
    for bad in (["h100"], ["h100=-1"], ["=3"], ["x=cheap"]):
        with pytest.raises(Exception, match="NAME=USD"):
            parse_prices(bad)


def test_the_idle_alarm_lists_running_jobs_idle_past_the_threshold_only():
    now = 10_000.0
    uses = [use("idle", "t", "h100-sxm", 1, 0, None, util=0.01, tail=1900),
            use("busy", "t", "h100-sxm", 1, 0, None, util=0.9, tail=0),
            use("done", "t", "h100-sxm", 1, 0, 50, util=0.0, tail=5000),
            use("unmeasured", "t", "h100-sxm", 1, 0, None)]  # fmt: skip
    assert [j["job"] for j in idle_now(uses, now, 1800)] == ["idle"]
    assert idle_now(uses, now, 3600) == []


def test_own_or_rent_uses_the_measured_utilization_in_the_plans_own_tco(catalog):
    """Two H100s held 50 of 100 hours and busy 40 % of them: owned, they are busy 20 % of their hours, and the
    line is the plan's on-prem formula at 20 %, not at its assumed 60 %."""
    hour = 3600.0
    uses = [use("a", "t", "h100-sxm", 2, 0, 50 * hour, util=0.4)]
    [line] = own_or_rent(uses, now=100 * hour, since=0, catalog=catalog)
    assert line["gpus_needed"] == 2 and line["allocated_gpu_hours"] == pytest.approx(100)
    assert line["busy_share_of_allocation"] == pytest.approx(0.4) and line["owned_utilization"] == pytest.approx(0.2)
    cheapest = min(p.usd_per_gpu_hour for p in catalog.prices("h100-sxm"))
    assert line["rent_usd"] == pytest.approx(100 * cheapest)
    acc = catalog.accelerators["h100-sxm"]
    plan = onprem_cost(catalog, acc, 40, PlanRequest(gpu="h100-sxm", utilization=0.2), cheapest)
    assert line["own_usd"] == pytest.approx(plan["usd"])  # 40 busy GPU-hours at the plan's cost per busy hour
    assert line["cheaper"] == ("own" if plan["usd"] < 100 * cheapest else "rent")
    # fully busy allocations: the break-even is the plan's own
    [full] = own_or_rent([use("a", "t", "h100-sxm", 2, 0, 50 * hour, util=1.0)], 100 * hour, 0, catalog)
    assert full["breakeven_utilization"] == pytest.approx(plan["breakeven_utilization"], rel=1e-9)
    # a higher measured use makes owning cheaper per busy hour, never dearer
    [busier] = own_or_rent([use("a", "t", "h100-sxm", 2, 0, 50 * hour, util=0.9)], 100 * hour, 0, catalog)
    assert busier["own_usd"] / busier["busy_gpu_hours"] < line["own_usd"] / line["busy_gpu_hours"]


def test_an_endpoints_tokens_are_priced_on_the_hosted_api_beside_its_devices(tmp_path, monkeypatch, capsys):
    """A serving session of llama-3.1-8b on an H100 for an hour, 1,000 requests of 500 + 200 tokens: its hour at
    the site's price against the cheapest hosted API's price for the same tokens (plan/data/hosted_prices.csv)."""
    from gpuwise.cli import main
    from gpuwise.plan.hosted import hosted_prices
    from gpuwise.runs import db

    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct here: the record alone
    actual = {"requests": 1000, "seconds_up": 3600.0, "prompt_tokens": 500.0, "output_tokens": 200.0}
    data = {"kind": "serve", "model": "llama-3.1-8b", "actual": actual, "utilization": {"count": 1, "seconds": 3599.0}}
    db.record("serve", "cuda:h100-sxm", "llama-3.1-8b", data)
    assert main(["fleet", "--price", "h100-sxm=2.0", "--json"]) == 0
    [h] = json.loads(capsys.readouterr().out)["versus_hosted"]
    cheapest = min(a.usd_in * 0.5 + a.usd_out * 0.2 for a in hosted_prices("llama-3.1-8b"))  # per 1 M in + out
    assert (h["tokens_in"], h["tokens_out"], h["requests"]) == (500_000, 200_000, 1000)
    assert h["own_usd"] == pytest.approx(2.0) and h["hosted_usd"] == pytest.approx(cheapest)
    assert h["cheaper"] == ("hosted API" if cheapest < 2.0 else "own endpoint")
    assert main(["fleet", "--price", "h100-sxm=2.0"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "endpoint llama-3.1-8b: 1,000 requests, 0.5 M tokens in, 0.2 M out" in said and "is cheaper" in said


def test_a_job_older_than_the_window_counts_only_its_hours_inside_it(catalog):
    """A 90-day endpoint in a 30-day view: 30 days of device-hours in the groups, its whole 90 days as a job."""
    from dataclasses import replace

    day = 86400.0
    old = replace(use("ep", "t", "h100-sxm", 2, 0, None), window_start=60 * day)
    [row] = summarize([old], "team", 90 * day, catalog, {})
    assert row["gpu_hours"] == pytest.approx(2 * 30 * 24)
    assert old.seconds(90 * day) == 90 * day
