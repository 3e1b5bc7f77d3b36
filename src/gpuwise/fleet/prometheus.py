"""Utilization from a Prometheus server, for the jobs gpuwise did not measure itself: DCGM exporter's per-GPU
`DCGM_FI_DEV_GPU_UTIL`, which it labels with the Slurm job (`hpc_job`, from its job-mapping directory) or the
pod; or gpuwise serve's own `gpuwise_device_utilization_ratio`, labelled `hpc_job` too (hardware/usage.py). Read
through Prometheus's HTTP API (`/api/v1/query_range`), over each job's own start and end."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import replace

from gpuwise.errors import first_line
from gpuwise.fleet.sources import Use
from gpuwise.hardware.usage import IDLE_BELOW

TIMEOUT_S = 20
MAX_POINTS = 240  # per job: Prometheus refuses more than 11,000; a job's mean needs far fewer
# (query, scale to 0..1, what it is) in the order tried: DCGM first where a site runs it
QUERIES = (
    ('avg(DCGM_FI_DEV_GPU_UTIL{{hpc_job="{job}"}})', 0.01, "DCGM exporter, DCGM_FI_DEV_GPU_UTIL by hpc_job"),
    ('avg(DCGM_FI_DEV_GPU_UTIL{{pod="{job}"}})', 0.01, "DCGM exporter, DCGM_FI_DEV_GPU_UTIL by pod"),
    ('avg(gpuwise_device_utilization_ratio{{hpc_job="{job}"}})', 1.0, "gpuwise's /metrics, by hpc_job"),
)


def _query_range(url: str, query: str, start: float, end: float, step: float) -> list[tuple[float, float]]:
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=TIMEOUT_S) as r:
        body = json.loads(r.read(32 << 20))
    if body.get("status") != "success":
        raise ValueError(body.get("error") or "Prometheus refused the query")
    series = body.get("data", {}).get("result") or []
    if not series:
        return []
    return [(float(t), float(v)) for t, v in series[0].get("values", []) if v not in ("NaN", "+Inf", "-Inf")]


def with_prometheus(url: str, uses: list[Use], now: float) -> tuple[list[Use], str | None]:
    """Each job that has no measured use gets Prometheus's, where a query finds its series."""
    out, note = [], None
    for u in uses:
        if u.util is not None or note is not None or u.source not in ("slurm", "k8s"):
            out.append(u)
            continue
        end = u.end if u.end is not None else now
        step = max(1.0, (end - u.start) / MAX_POINTS)
        found = None
        for query, scale, what in QUERIES:
            try:
                points = _query_range(url, query.format(job=u.job.replace('"', "")), u.start, end, step)
            except (OSError, ValueError) as e:
                note = f"Prometheus at {url}: {first_line(e)}"
                break
            if points:
                found = (points, scale, what)
                break
        if found is None:
            out.append(u)
            continue
        points, scale, what = found
        values = [min(1.0, max(0.0, v * scale)) for _, v in points]
        tail = 0.0
        for t, v in reversed([(t, v * scale) for t, v in points]):
            if v >= IDLE_BELOW:
                break
            tail = points[-1][0] - t
        idle = sum(v < IDLE_BELOW for v in values) / len(values)
        out.append(replace(u, util=sum(values) / len(values), idle_share=idle, idle_tail_s=tail,
                           util_source=f"prometheus ({what}, {len(values)} points)"))  # fmt: skip
    return out, note
