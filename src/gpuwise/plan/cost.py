"""Cost of a job: GPU-hours x each provider's price, and the same job on owned hardware."""

from __future__ import annotations

from gpuwise.errors import GpuwiseError, closest
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.plan.request import HOST_POWER, KWH_USD, LIFE_YEARS, PUE, UTILIZATION, PlanRequest

HOURS_PER_YEAR = 8760


def check_provider(catalog: Catalog, provider: str | None) -> None:
    if provider is None:
        return
    names = {p.provider.lower() for p in catalog.cloud}
    if provider.lower() not in names:
        raise GpuwiseError(f"unknown provider '{provider}'{closest(provider.lower(), names)}")


def cloud_costs(catalog: Catalog, acc: Accelerator, gpu_hours: float, provider: str | None) -> list[dict]:
    rows = catalog.prices(acc.slug)
    if provider:
        rows = [p for p in rows if p.provider.lower() == provider.lower()]
    return [
        {
            "provider": p.provider,
            "usd": gpu_hours * p.usd_per_gpu_hour,
            "usd_per_gpu_hour": p.usd_per_gpu_hour,
            "kind": p.kind,
            "as_of": p.as_of,
            "source": p.source,
        }
        for p in rows
    ]


def _value(given, default) -> float:
    return given if given is not None else default.value


def onprem_cost(
    catalog: Catalog, acc: Accelerator, gpu_hours: float, req: PlanRequest, cheapest_cloud: float | None
) -> dict | None:
    """Purchase amortized over the life at the stated utilization, plus power at the wall.

    Break-even utilization: the share of its life an owned GPU must be busy for its cost per
    busy hour to equal the cheapest rental (above 1: renting is always cheaper)."""
    price = catalog.purchase_price(acc.slug)
    if price is None:
        return None
    life = _value(req.life_years, LIFE_YEARS)
    util = _value(req.utilization, UTILIZATION)
    kw = (acc.tdp_w or 0) / 1000 * HOST_POWER.value * _value(req.pue, PUE)
    power_per_hour = kw * _value(req.kwh_usd, KWH_USD)
    capex_per_hour = price.usd_per_gpu / (life * HOURS_PER_YEAR * util)
    breakeven = None
    if cheapest_cloud is not None and cheapest_cloud > power_per_hour:
        breakeven = price.usd_per_gpu / (life * HOURS_PER_YEAR * (cheapest_cloud - power_per_hour))
    return {
        "provider": "on-prem",
        "usd": gpu_hours * (capex_per_hour + power_per_hour),
        "usd_per_gpu_hour": capex_per_hour + power_per_hour,
        "purchase_usd_per_gpu": price.usd_per_gpu,
        "purchase_usd": price.usd,
        "purchase_gpus": price.gpus,
        "item": price.item,
        "as_of": price.as_of,
        "source": price.source,
        "power_kw_per_gpu": kw,
        "breakeven_utilization": breakeven,
        "power_known": acc.tdp_w is not None,
    }
