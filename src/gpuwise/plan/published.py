"""The capacity plan against published serving measurements (data/serving_measurements.csv): each row's set-up
(engine, GPU, TP, precision, model, lengths, load) planned, and the plan's error. `tests/test_capacity.py` holds
the rows marked held to their tolerance; `python -m gpuwise.plan.published` prints the table docs/plan.md quotes."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib import resources

from gpuwise.hardware.catalog import Catalog, load_catalog
from gpuwise.plan.capacity import gpu_replica
from gpuwise.plan.model import resolve_model
from gpuwise.plan.simulate import Request, poisson, simulate

TOLERANCE = 0.25  # the bar for TPOT at one request and throughput at saturation


@dataclass(frozen=True)
class Measurement:
    id: str
    engine: str
    gpu: str
    count: int
    tp: int
    precision: str
    kv_precision: str
    model: str
    prompt: int
    output: int
    load: str  # poisson (at `rate` requests/s), burst (`rate` requests at once), single (one request alone)
    rate: float
    metric: str  # tpot (mean, s), throughput (output tokens/s, all replicas), e2e (s)
    published: float
    held: str  # yes: within TOLERANCE; fitted: an assumption was chosen on it; no: outside, `note` says why
    source: str
    note: str


def measurements() -> list[Measurement]:
    text = resources.files("gpuwise.plan").joinpath("data", "serving_measurements.csv").read_text(encoding="utf-8")
    rows = []
    for r in csv.DictReader(text.splitlines()):
        typed = {
            "count": int(r["count"]),
            "tp": int(r["tp"]),
            "prompt": int(r["prompt"]),
            "output": int(r["output"]),
            "rate": float(r["rate"]),
            "published": float(r["published"]),
        }
        rows.append(Measurement(**(dict(r) | typed)))  # type: ignore[arg-type]  # typed: the numeric columns
    return rows


def reproduce(m: Measurement, catalog: Catalog) -> float:
    """The plan's figure for the row's set-up and metric."""
    replica = gpu_replica(resolve_model(m.model), catalog.get(m.gpu), m.precision, m.tp, None, m.kv_precision or None)
    assert replica is not None, m.id
    if m.load == "burst":
        reqs = [Request(0.0, m.prompt, m.output) for _ in range(int(m.rate))]
        out = simulate(replica.step, replica.limits, reqs, warmup=0, bounded=False)
    elif m.load == "poisson":
        out = simulate(replica.step, replica.limits, poisson(m.rate, 500, m.prompt, m.output))
    else:
        out = simulate(replica.step, replica.limits, [Request(0.0, m.prompt, m.output)], warmup=0)
    replicas = m.count // m.tp
    if m.metric == "throughput":
        return out.throughput * replicas
    values = out.tpot if m.metric == "tpot" else out.e2e
    return sum(values) / len(values)


def table(catalog: Catalog | None = None) -> str:
    """The markdown table of docs/plan.md: every row, planned beside published."""
    catalog = catalog or load_catalog()
    unit = {"tpot": ("TPOT", 1000, "ms"), "e2e": ("end to end", 1, "s"), "throughput": ("output", 1, "tok/s")}
    lines = [
        "| engine | GPUs | model, precision | in / out | load | metric | published | plan | error | held |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in measurements():
        name, scale, u = unit[m.metric]
        got = reproduce(m, catalog)
        load = {"poisson": f"Poisson {m.rate:g}/s", "burst": f"{m.rate:g} at once", "single": "one request"}[m.load]
        tp = f" (TP {m.tp})" if m.tp > 1 else ""
        kv = f", {m.kv_precision} KV" if m.kv_precision else ""
        lines.append(
            f"| {m.engine} | {m.count} x {m.gpu}{tp} | {m.model}, {m.precision}{kv} | {m.prompt} / {m.output} | "
            f"{load} | {name} | {m.published * scale:,.4g} {u} | {got * scale:,.4g} {u} | "
            f"{got / m.published - 1:+.0%} | {m.held} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
