"""Warnings for the classic mistakes, one line each, and the list of assumptions a plan used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuwise.hardware.catalog import price_age
from gpuwise.hardware.reference import GiB
from gpuwise.plan import request as r
from gpuwise.plan.memory import memory

if TYPE_CHECKING:
    from gpuwise.hardware.catalog import Catalog
    from gpuwise.plan.model import ModelSpec
    from gpuwise.plan.planner import Plan

HEADROOM = 0.10


def option_warnings(plan: Plan) -> list[str]:
    out: list[str] = []
    acc, layout, req, mem = plan.acc, plan.layout, plan.req, plan.mem
    if plan.compute is None:
        return out
    free = 1 - mem.total / acc.mem_bytes
    if plan.fits and free < HEADROOM:
        out.append(
            f"{acc.slug}: fits with only {free:.0%} headroom; a longer sequence or a fragmented "
            "allocator can still run out of memory"
        )
    what = "batch" if not req.training else "micro-batch"
    if not plan.fits and plan.max_batch >= 1:
        out.append(
            f"{acc.slug}: does not fit at {what} {req.batch}, fits up to {what} {plan.max_batch}"
            + (": keep the global batch with gradient accumulation" if req.training else "")
        )
    elif plan.fits and req.batch == 1 and plan.max_batch == 1 and req.training:
        out.append(f"{acc.slug}: fits only at micro-batch 1: no room left for a larger batch")
    if layout.gpus > acc.max_per_node:
        out.append(
            f"{acc.slug}: needs {layout.gpus} GPUs, more than one server holds ({acc.max_per_node}): "
            "traffic between servers crosses the network, far slower than NVLink"
        )
    if layout.tp > acc.nvlink_domain:
        link = "PCIe only" if acc.nvlink_domain == 1 else f"NVLink joins only {acc.nvlink_domain} cards"
        out.append(
            f"{acc.slug}: tensor parallel over {layout.tp} cards ({link}: {acc.interconnect}); every layer "
            "all-reduces over that link, so expect far below the estimated speed"
        )
    priced = sorted(plan.cost, key=lambda c: c["usd"])
    if priced and (age := price_age(priced[0]["as_of"]))[1]:
        c = priced[0]
        out.append(
            f"{acc.slug}: the {c['provider']} price ({c['usd_per_gpu_hour']} USD/h) is {age[0]}; check it before you "
            "rely on it"
        )
    return out


def plan_warnings(model: ModelSpec, req: r.PlanRequest, options: list[Plan], catalog: Catalog) -> list[str]:
    out = []
    cards = [a for a in catalog.accelerators.values() if a.kind != "cpu"]
    largest = max(cards, key=lambda a: a.mem_bytes)
    one = memory(model, req, r.Layout(1))
    if one.weights > largest.mem_bytes:
        out.append(
            f"{model.name} cannot fit on any single card: its {req.task} weights alone take "
            f"{one.weights / GiB:.0f} GiB, the largest card ({largest.slug}) has {largest.mem_gb:g} GiB"
        )
    if not any(o.fits for o in options):
        out.append(
            "nothing in the catalog fits: try --checkpointing full, a smaller --batch or --seq, "
            "--task lora/qlora, or more --gpus"
        )
    out += stale_purchase(options[0])
    best = options[0].compute
    if best and best.efficiency_origin == r.EFFICIENCY.origin:
        out.append(
            f"the time rests on the default efficiency {r.EFFICIENCY.value} of dense peak (PaLM's MFU); "
            "pass --efficiency with the share of peak your stack reaches"
        )
    return out


def stale_purchase(plan: Plan) -> list[str]:
    """A line where the recommendation's on-prem figure rests on a purchase price that is undated or more than a
    year old (its cloud price is flagged with the option: option_warnings)."""
    on = plan.onprem if plan.fits else None
    age, stale = price_age(on["as_of"]) if on else ("", False)
    if not (on and stale):
        return []
    return [
        f"the on-prem figure rests on a purchase price {age} ({on['item']}, {on['source']}): today's price may "
        "differ; pass --catalog with a quote of your own"
    ]


def assumptions_used(req: r.PlanRequest, plan: Plan) -> list[dict]:
    def item(name, given, default):
        return {
            "name": name,
            "value": given if given is not None else default.value,
            "origin": f"--{name.replace('_', '-')}" if given is not None else default.origin,
        }

    out = [
        {
            "name": "efficiency",
            "value": plan.compute.efficiency if plan.compute else r.EFFICIENCY.value,
            "origin": plan.compute.efficiency_origin if plan.compute else r.EFFICIENCY.origin,
        },
        {"name": "overhead_bytes", "value": r.OVERHEAD_BYTES.value, "origin": r.OVERHEAD_BYTES.origin},
        {"name": "allocator_slack", "value": r.ALLOCATOR_SLACK.value, "origin": r.ALLOCATOR_SLACK.origin},
    ]
    if plan.compute:
        out.append({"name": "tokens", "value": plan.compute.tokens, "origin": plan.compute.tokens_origin})
    if not req.training:
        out.append(
            {
                "name": "bandwidth_efficiency",
                "value": r.BANDWIDTH_EFFICIENCY.value,
                "origin": r.BANDWIDTH_EFFICIENCY.origin,
            }
        )
    if plan.onprem:
        out += [
            item("life_years", req.life_years, r.LIFE_YEARS),
            item("utilization", req.utilization, r.UTILIZATION),
            item("kwh_usd", req.kwh_usd, r.KWH_USD),
            item("pue", req.pue, r.PUE),
            {"name": "host_power", "value": r.HOST_POWER.value, "origin": r.HOST_POWER.origin},
        ]
    return out
