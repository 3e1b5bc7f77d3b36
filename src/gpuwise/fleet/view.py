"""The fleet, assembled once for the CLI (`gpuwise fleet`) and the UI's Fleet page: read every source, join,
and compute the figures (report.py), the GPU-hours by group over time and the utilization histogram."""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.fleet import report, sources
from gpuwise.fleet.sources import Use
from gpuwise.hardware.catalog import Catalog

_SPAN = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
BINS = 10  # the utilization histogram: 0-10 %, ..., 90-100 %


def seconds(text: str, flag: str) -> float:
    """A span such as 90s, 30m, 12h, 30d or 2w, in seconds; anything else is one line naming the flag."""
    found = _SPAN.match(text.strip().lower())
    if not found or float(found.group(1)) <= 0:
        raise GpuwiseError(f"{flag} {text!r}: give a span such as 90s, 30m, 12h, 30d or 2w")
    return float(found.group(1)) * _UNIT[found.group(2)]


@dataclass(frozen=True)
class Ask:
    """What a fleet view is asked for: the CLI's options, the UI's query."""

    since: str = "30d"
    by: str = "team"
    prices: list[str] = field(default_factory=list)
    gpu_types: list[str] = field(default_factory=list)
    ray: str | None = None
    prometheus: str | None = None
    idle: str | None = None


def build(ask: Ask, catalog: Catalog, now: float | None = None) -> dict[str, Any]:
    window = seconds(ask.since, "--since")
    idle_s = seconds(ask.idle, "--idle") if ask.idle else None
    prices = report.parse_prices(ask.prices)
    if ask.by not in report.GROUPS:
        report.summarize([], ask.by, 0, catalog, {})  # the one-line refusal
    types = report.parse_gpu_types(ask.gpu_types, catalog)
    now = time.time() if now is None else now
    start = now - window
    notes: list[str] = []
    served: list = []
    mine, launched, note = sources.record_uses(start, now, served)
    notes += [note] if note else []
    slurm, note = sources.slurm_jobs(start, now)
    notes += [note] if note else []
    address = ask.ray or os.environ.get("RAY_ADDRESS")
    ray_uses: list[Use] = []
    if address:
        ray_uses, note = sources.ray_jobs(address, start)
        notes += [note] if note else []
    uses = [replace(u, gpu=types.get(u.gpu, u.gpu), window_start=start)
            for u in sources.join(slurm + ray_uses, launched) + mine]  # fmt: skip
    if ask.prometheus:
        # here, not at the top: only with --prometheus
        from gpuwise.fleet.prometheus import with_prometheus

        uses, note = with_prometheus(ask.prometheus, uses, now)
        notes += [note] if note else []
    # the charts count GPU-hours; a fleet with no GPU job (a CPU machine) charts its CPU core-hours instead
    charted = [u for u in uses if u.gpu != "cpu"] or uses
    unit = "GPU-hours" if any(u.gpu != "cpu" for u in uses) else "CPU core-hours"
    result: dict[str, Any] = {
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "until": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "by": ask.by,
        "sources": {"slurm": len(slurm), "ray": len(ray_uses), "gpuwise": len(mine)},
        "notes": notes,
        "groups": report.summarize(uses, ask.by, now, catalog, prices),
        "idlest": report.idlest(uses, now),
        "own_or_rent": report.own_or_rent(uses, now, start, catalog),
        "versus_hosted": report.versus_hosted(served, catalog, prices),
        "timeline": timeline(charted, ask.by, start, now) | {"unit": unit},
        "histogram": histogram(charted, now) | {"unit": unit},
        "jobs": [report._job(u, now) for u in uses],
    }
    if idle_s is not None:
        result["idle"] = report.idle_now(uses, now, idle_s)
    return result


def timeline(uses: list[Use], by: str, start: float, now: float) -> dict[str, Any]:
    """Device-hours per group in each bucket of the window (hours under 3 days, else days): each job's hours
    split by its overlap with each bucket, so that the buckets add up to the group's total."""
    step = 3600.0 if now - start <= 3 * 86400 else 86400.0
    n = max(1, int((now - start) // step) + 1)
    edges = [start + i * step for i in range(n + 1)]
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    for u in uses:
        end = u.end if u.end is not None else now
        first = max(0, int((max(u.start, start) - start) // step))
        for i in range(first, n):
            lo, hi = max(u.start, edges[i]), min(end, edges[i + 1])
            if hi <= lo:
                if edges[i] >= end:
                    break
                continue
            series[str(getattr(u, by))][i] += u.devices * (hi - lo) / 3600
    return {"bucket_s": step, "starts": edges[:-1], "series": dict(sorted(series.items()))}


def histogram(uses: list[Use], now: float) -> dict[str, Any]:
    """Measured device-hours by utilization, in tenths: how much of the held time ran at which use."""
    hours = [0.0] * BINS
    for u in uses:
        if u.util is not None:
            hours[min(BINS - 1, int(u.util * BINS))] += u.device_hours(now)
    return {"bins": [i / BINS for i in range(BINS + 1)], "device_hours": hours}
