"""The fleet's figures from its uses: per group, jobs, device-hours allocated and busy, utilization and the
idle share, cost; the jobs that held devices idle longest; the idle alarm; and own or rent at the measured
use. Every figure says where it comes from (docs/fleet.md)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpuwise.errors import GpuwiseError, closest
from gpuwise.fleet.sources import Served, Use
from gpuwise.hardware.catalog import Catalog
from gpuwise.plan.cost import HOURS_PER_YEAR, onprem_cost
from gpuwise.plan.hosted import hosted_prices
from gpuwise.plan.request import KWH_USD, LIFE_YEARS, PlanRequest

GROUPS = ("team", "user", "workload", "engine", "gpu")


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str


def parse_prices(given: list[str]) -> dict[str, Price]:
    """--price NAME=USD/h: a site's own price per device-hour (a catalog slug, a Slurm gres type, gpu, cpu)."""
    out = {}
    for item in given:
        name, sep, value = item.partition("=")
        try:
            usd = float(value.removesuffix("/h"))
        except ValueError:
            usd = -1.0
        if not sep or not name or not usd >= 0:
            raise GpuwiseError(f"--price {item!r}: give NAME=USD per device-hour, e.g. --price h100-sxm=2.10")
        out[name] = Price(usd, f"--price {name}={usd:g} (the site's own)")
    return out


def parse_gpu_types(given: list[str], catalog: Catalog) -> dict[str, str]:
    """--gpu-type NAME=SLUG: a site's Slurm GPU type (or gpu, untyped) as the catalog GPU it is."""
    out = {}
    for item in given:
        name, sep, slug = item.partition("=")
        if not sep or not name or not slug:
            raise GpuwiseError(f"--gpu-type {item!r}: give NAME=SLUG, e.g. --gpu-type a100=a100-80gb")
        catalog.get(slug)  # an unknown slug: one line with the nearest names
        out[name] = slug.lower()
    return out


def price_of(gpu: str, catalog: Catalog, prices: dict[str, Price]) -> Price | None:
    """The user's price for this device, else the catalog's cheapest dated cloud price; None if neither."""
    if gpu in prices:
        return prices[gpu]
    if gpu != "cpu" and "gpu" in prices:
        return prices["gpu"]
    rows = catalog.prices(gpu) if gpu in catalog.accelerators else []
    if not rows:
        return None
    best = min(rows, key=lambda p: p.usd_per_gpu_hour)
    return Price(best.usd_per_gpu_hour, f"{best.provider} {best.kind}, as of {best.as_of} (catalog)")


def summarize(uses: list[Use], by: str, now: float, catalog: Catalog, prices: dict[str, Price]) -> list[dict]:
    """One row per group: jobs, device-hours allocated, busy (where measured), utilization, idle share, cost."""
    if by not in GROUPS:
        raise GpuwiseError(f"--by {by!r}: one of {', '.join(GROUPS)}{closest(by, set(GROUPS))}")
    groups: dict[str, list[Use]] = defaultdict(list)
    for u in uses:
        groups[str(getattr(u, by))].append(u)
    rows = []
    for name, members in sorted(groups.items()):
        alloc = sum(u.device_hours(now) for u in members)
        measured = [u for u in members if u.util is not None]
        m_alloc = sum(u.device_hours(now) for u in measured)
        busy = sum(u.device_hours(now) * (u.util or 0) for u in measured)
        idle = sum(u.device_hours(now) * (u.idle_share or 0) for u in measured if u.idle_share is not None)
        cost, sources = 0.0, set()
        unpriced = 0.0
        for u in members:
            p = price_of(u.gpu, catalog, prices)
            if p is None:
                unpriced += u.device_hours(now)
                continue
            cost += u.device_hours(now) * p.usd_per_hour
            sources.add(p.source)
        rows.append({
            by: name,
            "jobs": len(members),
            "running": sum(u.running for u in members),
            "device_hours": alloc,
            "gpu_hours": sum(u.device_hours(now) for u in members if u.gpu != "cpu"),
            "cpu_core_hours": sum(u.device_hours(now) for u in members if u.gpu == "cpu"),
            "measured_hours": m_alloc,
            "busy_hours": busy if measured else None,
            "utilization": busy / m_alloc if m_alloc else None,
            "idle_share": idle / m_alloc if m_alloc else None,
            "usd": cost if sources else None,
            "unpriced_hours": unpriced,
            "price_sources": sorted(sources),
        })  # fmt: skip
    return rows


def idlest(uses: list[Use], now: float, n: int = 5) -> list[dict]:
    """The jobs that held devices idle the longest: idle device-hours, measured."""
    scored = [(u.device_hours(now) * u.idle_share, u) for u in uses if u.idle_share is not None and u.idle_share > 0]
    return [dict(_job(u, now), idle_device_hours=h) for h, u in sorted(scored, key=lambda x: -x[0])[:n]]


def idle_now(uses: list[Use], now: float, threshold_s: float) -> list[dict]:
    """Running jobs and endpoints whose devices have been allocated but idle for longer than the threshold."""
    return [_job(u, now) for u in uses if u.running and u.idle_tail_s is not None and u.idle_tail_s > threshold_s]


def _job(u: Use, now: float) -> dict[str, Any]:
    return {
        "source": u.source, "job": u.job, "name": u.name, "user": u.user, "team": u.team, "workload": u.workload,
        "engine": u.engine, "gpu": u.gpu, "devices": u.devices, "state": u.state, "hours": u.seconds(now) / 3600,
        "device_hours": u.device_hours(now), "utilization": u.util, "idle_share": u.idle_share,
        "idle_for_s": u.idle_tail_s, "utilization_source": u.util_source, "run_dir": u.run_dir,
    }  # fmt: skip


def own_or_rent(uses: list[Use], now: float, since: float, catalog: Catalog) -> list[dict]:
    """Per catalog GPU in use: what the measured use cost rented (every allocated hour is billed), what owning the
    GPUs it needed costs over the same window (the plan's TCO: purchase over its life, power while busy, at the
    measured utilization instead of the assumed 60 %), which is cheaper, and from what utilization of the owned
    GPUs owning would win."""
    out = []
    by_gpu: dict[str, list[Use]] = defaultdict(list)
    for u in uses:
        by_gpu[u.gpu].append(u)
    window_h = max((now - since) / 3600, 1e-9)
    for gpu, members in sorted(by_gpu.items()):
        acc = catalog.accelerators.get(gpu)
        rents = catalog.prices(gpu) if acc is not None and acc.kind == "gpu" else []
        owned = _peak_concurrent(members, now)  # the GPUs one would have to own to run this schedule
        if acc is None or not rents or owned <= 0:
            continue
        rent = min(rents, key=lambda p: p.usd_per_gpu_hour)
        alloc = sum(u.device_hours(now) for u in members)
        measured = [u for u in members if u.util is not None]
        m_alloc = sum(u.device_hours(now) for u in measured)
        busy_share = sum(u.device_hours(now) * (u.util or 0) for u in measured) / m_alloc if m_alloc else None
        busy_h = alloc * (busy_share if busy_share is not None else 1.0)
        util_owned = max(busy_h / (owned * window_h), 1e-9)  # the share of the owned GPUs' hours they would be busy
        own = onprem_cost(catalog, acc, busy_h, PlanRequest(gpu=gpu, utilization=util_owned), rent.usd_per_gpu_hour)
        if own is None:
            continue
        rent_usd = alloc * rent.usd_per_gpu_hour
        # owning costs capex_h per owned hour + power per busy hour; renting bills every allocated hour: owning
        # wins above u* = capex_h / (price / busy_share - power) of the owned hours busy
        capex_h = own["purchase_usd_per_gpu"] / (LIFE_YEARS.value * HOURS_PER_YEAR)  # as onprem_cost takes them
        power_h = own["power_kw_per_gpu"] * KWH_USD.value
        per_busy_rent = rent.usd_per_gpu_hour / (busy_share or 1.0)
        breakeven = capex_h / (per_busy_rent - power_h) if per_busy_rent > power_h else None
        out.append({
            "gpu": gpu, "gpus_needed": owned, "window_hours": window_h, "allocated_gpu_hours": alloc,
            "busy_share_of_allocation": busy_share, "utilization_measured": busy_share is not None,
            "busy_gpu_hours": busy_h, "owned_utilization": util_owned,
            "rent_usd": rent_usd, "rent_price": f"${rent.usd_per_gpu_hour:.2f}/GPU-h, {rent.provider} {rent.kind}, "
            f"as of {rent.as_of}", "own_usd": own["usd"],
            "own_basis": f"{own['item']}: ${own['purchase_usd_per_gpu']:,.0f}/GPU as of {own['as_of']}, the plan's "
            "life, power and PUE assumptions",
            "breakeven_utilization": breakeven, "cheaper": "own" if own["usd"] < rent_usd else "rent",
        })  # fmt: skip
    return out


def _peak_concurrent(members: list[Use], now: float) -> float:
    events = sorted([(u.start, u.devices) for u in members] + [(u.end if u.end is not None else now, -u.devices)
                                                               for u in members])  # fmt: skip
    peak = level = 0.0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def versus_hosted(served: list[Served], catalog: Catalog, prices: dict[str, Price]) -> list[dict]:
    """Per served model with a hosted API in the price table (plan/data/hosted_prices.csv): the tokens its
    sessions served, what the devices held for them cost, and the cheapest hosted API's price for the same
    tokens."""
    by_model: dict[str, list[Served]] = defaultdict(list)
    for s in served:
        by_model[s.model].append(s)
    out = []
    for model, sessions in sorted(by_model.items()):
        apis = hosted_prices(model)
        if not apis:
            continue
        tokens_in, tokens_out = sum(s.tokens_in for s in sessions), sum(s.tokens_out for s in sessions)
        own, priced = 0.0, True
        for s in sessions:
            p = price_of(s.gpu, catalog, prices)
            priced &= p is not None
            own += s.devices * s.seconds / 3600 * (p.usd_per_hour if p else 0)
        api = min(apis, key=lambda a: a.usd_in * tokens_in + a.usd_out * tokens_out)
        hosted = (api.usd_in * tokens_in + api.usd_out * tokens_out) / 1e6
        out.append({
            "model": model, "sessions": len(sessions), "requests": sum(s.requests for s in sessions),
            "tokens_in": tokens_in, "tokens_out": tokens_out,
            "device_hours": sum(s.devices * s.seconds / 3600 for s in sessions),
            "own_usd": own if priced else None,
            "hosted_usd": hosted,
            "hosted": f"{api.provider} {api.api_model} (${api.usd_in}/M in, ${api.usd_out}/M out, as of {api.as_of})",
            "cheaper": None if not priced else ("hosted API" if hosted < own else "own endpoint"),
        })  # fmt: skip
    return out
