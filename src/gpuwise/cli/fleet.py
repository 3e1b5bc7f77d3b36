"""`gpuwise fleet`: who used which GPUs, how much of them, at what cost, and whether owning pays (docs/fleet.md)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.table import Table

from gpuwise.cli.options import CatalogOpt, JsonOpt, console, emit, load_catalog
from gpuwise.errors import GpuwiseError

EPILOG = (
    "Examples: gpuwise fleet · gpuwise fleet --since 7d --by user · gpuwise fleet --price h100-sxm=2.10 "
    "(your own price per GPU-hour) · gpuwise fleet --idle 30m (exit 1 when any job holds idle GPUs)"
)


def fleet(
    since: Annotated[str, typer.Option(help="How far back: 30d, 12h, 2w.")] = "30d",
    by: Annotated[str, typer.Option(help="Group by team (Slurm account), user, workload, engine or gpu.")] = "team",
    price: Annotated[
        list[str] | None,
        typer.Option(
            help="Your own price per device-hour, NAME=USD (a catalog GPU, a Slurm GPU type, gpu for any GPU, cpu "
            "per core-hour); repeatable. Default: the catalog's cheapest dated cloud price.",
            metavar="NAME=USD",
        ),
    ] = None,
    gpu_type: Annotated[
        list[str] | None,
        typer.Option(
            help="The catalog GPU a site's Slurm GPU type is, NAME=SLUG (gpu=h100-sxm for untyped gres/gpu); "
            "repeatable: then cost and own-or-rent use the catalog's prices for it.",
            metavar="NAME=SLUG",
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(help="A Ray cluster's dashboard to read jobs from [RAY_ADDRESS; none].", metavar="ADDRESS"),
    ] = None,
    prometheus: Annotated[
        str | None,
        typer.Option(
            help="A Prometheus server (http://HOST:9090) to read the use of jobs gpuwise did not measure: DCGM "
            "exporter's GPU utilization by Slurm job (hpc_job) or pod, or gpuwise serve's own gauges.",
            metavar="URL",
        ),
    ] = None,
    idle: Annotated[
        str | None,
        typer.Option(
            help="List the running jobs and endpoints whose devices have been idle longer than this (30m), and exit "
            "1 when there are any: for cron or CI.",
            metavar="SPAN",
        ),
    ] = None,
    catalog_file: CatalogOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """GPU-hours allocated and busy per team, user, workload, engine or GPU; cost; idle jobs; own or rent."""
    # here, not at the top: `gpuwise --help` and the other commands start without them
    from gpuwise.fleet.view import Ask, build

    ask = Ask(since, by, price or [], gpu_type or [], ray, prometheus, idle)
    result = build(ask, load_catalog(catalog_file))
    if as_json:
        emit(result)
    else:
        _show(result, idle)
    if idle is not None and result["idle"]:  # the alarm: exit 1 (2 is bad input), for cron or CI
        n = len(result["idle"])
        raise GpuwiseError(f"{n} running job{'s' if n > 1 else ''} or endpoint{'s' if n > 1 else ''} held idle longer "
                           f"than {idle} (listed above)", exit_code=1)  # fmt: skip


def _h(x: float | None) -> str:
    """Hours: two decimals, or three significant digits below 1 (a short test run's 0.000417 h is not 0.00)."""
    if x is None:
        return "-"
    return f"{x:,.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def _usd(x: float) -> str:
    return f"${x:,.2f}" if x >= 1 or x == 0 else f"${x:.2g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _show(r: dict, idle: str | None) -> None:
    for note in r["notes"]:
        console.print(f"note: {note}", highlight=False)
    s = r["sources"]
    console.print(f"fleet {r['since']} to {r['until']}: {s['slurm']} Slurm jobs (sacct), {s['ray']} Ray jobs, "
                  f"{s['gpuwise']} gpuwise runs and sessions (the record)", highlight=False)  # fmt: skip
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in (r["by"], "jobs", "GPU-h", "CPU core-h", "busy (measured)", "utilization", "idle", "cost"):
        t.add_column(col, justify="left" if col == r["by"] else "right")
    for g in r["groups"]:
        cost = "-" if g["usd"] is None else _usd(g["usd"])
        t.add_row(g[r["by"]], str(g["jobs"]), _h(g["gpu_hours"]), _h(g["cpu_core_hours"]),
                  "-" if g["busy_hours"] is None else f"{_h(g['busy_hours'])} of {_h(g['measured_hours'])}",
                  _pct(g["utilization"]), _pct(g["idle_share"]), cost)  # fmt: skip
    console.print(t)
    priced = sorted({src for g in r["groups"] for src in g["price_sources"]})
    if priced:
        console.print("cost at: " + "; ".join(priced), highlight=False)
    if r["idlest"]:
        console.print("held idle longest (idle device-hours, measured):", highlight=False)
        for j in r["idlest"]:
            console.print(f"  {j['source']} {j['job']} {j['name']} ({j['team']}/{j['user']}, {j['devices']:g} x "
                          f"{j['gpu']}): {j['idle_device_hours']:.2f} h idle of {j['device_hours']:.2f}, "
                          f"utilization {_pct(j['utilization'])}", highlight=False)  # fmt: skip
    for o in r["own_or_rent"]:
        measured = "measured" if o["utilization_measured"] else "not measured: taken as fully busy"
        be = o["breakeven_utilization"]
        other = ("owning would win from " + _pct(be) + " of the owned GPUs' hours busy") if be and o["cheaper"] == \
            "rent" else (("renting would win below " + _pct(be)) if be else "renting never costs more")
        console.print(
            f"{o['gpu']}: {_h(o['allocated_gpu_hours'])} GPU-h allocated, busy {_pct(o['busy_share_of_allocation'])} "
            f"of it ({measured}); rented {_usd(o['rent_usd'])} ({o['rent_price']}), owned {o['gpus_needed']:g} GPUs "
            f"{_usd(o['own_usd'])} ({o['own_basis']}), busy {_pct(o['owned_utilization'])} of their hours: "
            f"{o['cheaper']} is cheaper; {other}", highlight=False)  # fmt: skip
    for h in r["versus_hosted"]:
        own = "-" if h["own_usd"] is None else _usd(h["own_usd"])
        said = f"{h['cheaper']} is cheaper" if h["cheaper"] else "the devices are unpriced (--price)"
        console.print(f"endpoint {h['model']}: {h['requests']:,} requests, {h['tokens_in'] / 1e6:.3g} M tokens in, "
                      f"{h['tokens_out'] / 1e6:.3g} M out on {_h(h['device_hours'])} device-hours: {own}; the same "
                      f"tokens on {h['hosted']}: {_usd(h['hosted_usd'])}; {said}", highlight=False)  # fmt: skip
    if idle is not None:
        if not r["idle"]:
            console.print(f"no running job or endpoint has been idle longer than {idle}", highlight=False)
        for j in r["idle"]:
            console.print(f"IDLE {j['source']} {j['job']} {j['name']} ({j['team']}/{j['user']}): {j['devices']:g} x "
                          f"{j['gpu']} idle for {j['idle_for_s']:.0f} s", highlight=False)  # fmt: skip
