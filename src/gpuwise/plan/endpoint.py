"""One endpoint's serving plan, asked by everything that serves: `gpuwise plan --task serve` and the ui plan with
this machine's measured engines (`serving_plan`); `gpuwise serve` prints at start the goodput its engine is
planned to hold (`startup_line`) and, when it stops, records what it met beside what the plan expected at that
traffic (`session_plan`).

The replica an endpoint is planned as: on a CPU, the newest `gpuwise bench --serve` record of that model and
engine on this host (none: the plan says how to measure it); on a GPU, the catalog's row for it, as vLLM on one
GPU (plan/capacity.py: gpu_replica)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Catalog
from gpuwise.plan.capacity import Replica, capacity_plan, goodput, gpu_replica, measured_replica, run_at
from gpuwise.plan.memory import BYTES
from gpuwise.plan.model import ModelSpec, resolve_model
from gpuwise.plan.request import RANGES
from gpuwise.plan.simulate import percentile
from gpuwise.plan.traffic import DEFAULT_HOURS_PER_DAY, DEFAULT_TARGETS, PROFILES, Targets, Traffic, check_hours
from gpuwise.runs import db

# The profile a start-up plan is stated at (with traffic.py's default targets).
DEFAULT_PROFILE = "chat"
# Fewer simulated requests than the plan's 800, so that the start-up line adds little to the server's start
# (the 95th percentile then rests on 10 requests beyond it; `gpuwise plan --task serve` gives the finer figure).
STARTUP_REQUESTS = 200


def serve_fits(model: str, host: str, path: Path | None = None) -> list[dict[str, Any]]:
    """The newest `gpuwise bench --serve` record of `model` on `host` for each engine and the weights it held, with
    its record id."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in db.rows("bench-serve", path):
        d = row["data"]
        if d.get("model") == model and d.get("host") == host and isinstance(d.get("fit"), dict):
            newest[str(d.get("engine")), str(d.get("weights", ""))] = d | {"id": row["id"]}
    return list(newest.values())


def _host() -> str:
    # here, not at the top: the catalog's GPUs plan without detecting this machine
    from gpuwise.hardware.cpu import detect_cpu

    return detect_cpu().model


def measured_here(model: str, spec: ModelSpec) -> list[dict[str, Any]]:
    """This machine's measured engines for `model` (as given, or under its planner name)."""
    host = _host()
    return serve_fits(model, host) or serve_fits(spec.name, host)


def serving_plan(
    model: str,
    demand: Traffic,
    goal: Targets,
    catalog: Catalog,
    precision: str = "bf16",
    hours_day: float = DEFAULT_HOURS_PER_DAY,
    gpu: str | None = None,
    efficiency: float | None = None,
) -> dict[str, Any]:
    """`gpuwise plan --task serve`: every accelerator's option, and this machine's measured engines where the
    plan covers this CPU. A record that cannot be read costs only this machine's option, with a warning
    (in "warnings"). Every figure is checked here, for the CLI and the ui alike."""
    hours_day = check_hours(hours_day)
    low, high = next((lo, hi) for flag, _, lo, hi, _ in RANGES if flag == "--efficiency")
    if efficiency is not None and not low <= efficiency <= high:
        raise GpuwiseError(f"--efficiency must be at least {low:g} and at most {high:g}, not {efficiency:g}")
    spec = resolve_model(model)
    measured, warnings = None, []
    if gpu in (None, "cpu"):
        try:
            measured = measured_here(model, spec)
        except GpuwiseError as e:
            warnings.append(f"planning without this machine's measured steps: {e}")
    result = capacity_plan(spec, demand, goal, catalog, precision, hours_day, gpu, efficiency, measured)
    result["warnings"] = warnings
    return result


def endpoint_replica(
    model: str, engine: str, device: str, precision: str, catalog: Catalog, weights: str = "bf16"
) -> tuple[Replica | None, str]:
    """The replica a server of `model` on `engine` and `device` is planned as, or None and why not. On a CPU, from
    the last `gpuwise bench --serve` of that engine here with the same `weights` (`serve --weights`; a record
    that does not say its weights is taken for any)."""
    try:
        spec = resolve_model(model)
    except GpuwiseError as e:
        return None, f"not planned: {e}"
    if not spec.causal:
        return None, f"not planned: {spec.name} generates no tokens"
    # here, not at the top: the catalog's GPUs plan without detecting this machine
    from gpuwise.hardware.devices import here

    acc, _ = here(catalog)
    if device == "cpu":
        fits = [f for f in measured_here(model, spec) if f.get("engine") == engine]
        fits = [f for f in fits if f.get("weights", weights) in (weights, "auto")]
        if not fits:
            flag = f" --weights {weights}" if weights in ("int8", "int4") else ""
            return None, f"not measured here: `gpuwise bench --serve {model} --engine {engine}{flag}` measures it"
        try:
            return measured_replica(spec, acc, fits[-1]), ""
        except (KeyError, TypeError) as e:  # a hand-edited record
            return None, f"record #{fits[-1].get('id')} is damaged ({e!r}): run `gpuwise bench --serve` again"
    replica = gpu_replica(spec, acc, precision if precision in BYTES else "bf16", 1)
    if replica is None:
        return None, f"not planned: {spec.name}'s weights leave one {acc.name} no room for a KV cache"
    if engine != "vllm":
        replica = replace(replica, source=f"{replica.source} (vLLM's scheduler and steps; this server runs {engine})")
    return replica, ""


def startup_traffic(context: int) -> Traffic:
    """The default profile's request, cut to the served context."""
    p = PROFILES[DEFAULT_PROFILE]
    prompt, output = p.prompt_tokens, p.output_tokens
    if prompt + output > context:
        prompt = max(1, context - output)
    return Traffic(1.0, prompt, output, f"{DEFAULT_PROFILE} profile ({p.source})")


def startup_line(replica: Replica | None, why: str, context: int) -> tuple[str, dict[str, Any] | None]:
    """What `gpuwise serve` prints at start: the goodput of one replica at the default targets, and its data
    for /v1/info and the session's record."""
    t = DEFAULT_TARGETS
    at = f"TTFT <= {t.ttft:g} s and TPOT <= {t.tpot:g} s for {t.percentile:g} % of requests"
    if replica is None:
        return f"goodput at {at}: {why}", None
    traffic = startup_traffic(context)
    g = goodput(replica, traffic, t, n=STARTUP_REQUESTS)
    shape = f"{traffic.prompt_tokens:,} tokens in, {traffic.output_tokens:,} out ({DEFAULT_PROFILE} profile)"
    if g.rate > 0:
        held = f"{g.rate:.3g} requests/s ({g.rate * 3600:,.0f} an hour) of {shape}; bound by {g.binds}"
    else:  # even one request alone misses a target: say by how much, and how to plan other requests
        alone = g.alone.outcome if g.alone else None
        ttft1, tpot1 = (max(alone.ttft), max(alone.tpot)) if alone else (math.nan, math.nan)
        held = (
            f"none of {shape}: one alone is planned at TTFT {ttft1:.2f} s, TPOT {tpot1 * 1e3:.0f} ms "
            f"(`gpuwise plan --task serve --gpu {replica.acc.slug if replica.acc.kind != 'cpu' else 'cpu'} "
            f"--prompt-tokens N --output-tokens N` plans other requests)"
        )
    line = f"goodput at {at}: {held}; planned from {replica.source}"
    data = {
        "goodput_rps": g.rate,
        "binds": g.binds,
        "targets": t.as_dict(),
        "traffic": traffic.as_dict(),
        "source": replica.source,
    }
    return line, data


def session_plan(
    replica: Replica, prompt_tokens: float, output_tokens: float, rate: float, targets: Targets = DEFAULT_TARGETS
) -> dict[str, Any]:
    """What the plan expects of the traffic a session met (its mean lengths, its mean rate): latencies at that
    rate, and the goodput of one replica at those lengths."""
    traffic = Traffic(rate, max(1, round(prompt_tokens)), max(1, round(output_tokens)), "the session's own")
    load = run_at(replica, traffic, targets, rate, n=STARTUP_REQUESTS)
    o, q = load.outcome, targets.percentile
    return {
        "ttft_p50": percentile(o.ttft, 50),
        f"ttft_p{q:g}": percentile(o.ttft, q),
        "tpot_p50": percentile(o.tpot, 50),
        f"tpot_p{q:g}": percentile(o.tpot, q),
        "attainment": load.attainment,
        "goodput_rps": goodput(replica, traffic, targets, n=STARTUP_REQUESTS).rate,
        "source": replica.source,
    }
