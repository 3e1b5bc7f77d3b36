"""The serving capacity plan: for a traffic and latency targets, how many GPUs of each accelerator, in how many
replicas, at what cost a month, against a hosted API.

For each accelerator: the replica (tensor-parallel degree, the KV cache its memory leaves, the engine's scheduler
limits), its goodput (the highest arrival rate at which the target share of requests meets both the TTFT and the
TPOT target: DistServe's, Zhong et al. OSDI 2024) found by simulating the scheduler (simulate.py) at rates
bisected between none and saturation, the replicas the traffic needs, and the latency at that traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.plan.engines import GPU_MEMORY_UTILIZATION, vllm_scheduler
from gpuwise.plan.hosted import HostedPrice, hosted_prices
from gpuwise.plan.memory import BYTES, kv_bytes_per_token
from gpuwise.plan.model import ModelSpec
from gpuwise.plan.request import (
    BANDWIDTH_EFFICIENCY,
    EFFICIENCY,
    HOST_POWER,
    KWH_USD,
    LIFE_YEARS,
    OVERHEAD_BYTES,
    PUE,
    Assumption,
)
from gpuwise.plan.simulate import Limits, Outcome, percentile, poisson, simulate
from gpuwise.plan.traffic import Targets, Traffic

# A step's fixed time on a GPU, whatever it computes: scheduling, input preparation, sampling and the kernel
# launches a CUDA graph replays. Chosen on one published measurement (its origin below; docs/plan.md).
STEP_OVERHEAD = Assumption(0.002, "fitted: 2 ms a step (TensorRT-LLM, Llama-3.1-8B BF16, 1 x H100, ITL 8 ms at 2 QPS)")
# Tensor parallel: two all-reduces a layer each step, each costing at least a latency on NVLink.
ALLREDUCE_S = Assumption(25e-6, "assumption: 25 us an all-reduce (2 a layer) within an NVLink domain")
# A step's compute runs at a share of the dense peak; the training MFU is the stated default (request.py).
SERVE_EFFICIENCY = EFFICIENCY
REQUESTS = 800  # simulated per rate: the 95th percentile rests on 40 requests beyond it
SEARCH_STEPS = 12  # bisections of the rate: the goodput to within 0.03 % of the bracket
HOURS_PER_MONTH_DAY = 365 / 12  # days a month


@dataclass(frozen=True)
class Roofline:
    """A step's time on a GPU: a fixed overhead plus the slower of the weights and the KV cache read at the
    achieved bandwidth and the FLOPs at the achieved peak. Per GPU of a tensor-parallel replica. Its FLOPs count
    every token's logits, so `outputs` adds nothing here."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float  # 2 x the parameters a token multiplies
    pair_flops: float  # attention: one query token against one cached token, QK^T and AV (4 x layers x heads x dim)
    flops_per_s: float
    bytes_per_s: float
    overhead_s: float

    def _parts(self, tokens: float, kv_tokens: float, pairs: float) -> tuple[float, float]:
        compute = (tokens * self.flops_per_token + pairs * self.pair_flops) / self.flops_per_s
        memory = (self.weight_bytes + kv_tokens * self.kv_bytes_per_token) / self.bytes_per_s
        return compute, memory

    def seconds(self, tokens: float, kv_tokens: float, pairs: float, outputs: float = 0.0) -> float:
        return self.overhead_s + max(self._parts(tokens, kv_tokens, pairs))

    def compute_bound(self, tokens: float, kv_tokens: float, pairs: float, outputs: float = 0.0) -> bool:
        compute, memory = self._parts(tokens, kv_tokens, pairs)
        return compute > memory


@dataclass(frozen=True)
class Fitted:
    """A step measured on this machine (`gpuwise bench --serve`): a + b x tokens + c x context read + d x attention
    pairs + e x outputs, fitted by non-negative least squares to the engine's measured prefill and decode
    times. A CPU's step grows with what it computes and reads alike; there is no roofline corner to find. `e`
    is what a sequence that samples costs beyond a prompt token: its logits and its sampling (llama-server
    samples each row in turn on one thread; a decoding row cost it 4-5 ms here against 3 ms a prompt token)."""

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0  # records before `e` was fitted have none

    def seconds(self, tokens: float, kv_tokens: float, pairs: float, outputs: float = 0.0) -> float:
        return self.a + self.b * tokens + self.c * kv_tokens + self.d * pairs + self.e * outputs

    def compute_bound(self, tokens: float, kv_tokens: float, pairs: float, outputs: float = 0.0) -> bool:
        return self.b * tokens + self.d * pairs + self.e * outputs > self.a + self.c * kv_tokens


@dataclass(frozen=True)
class Replica:
    """One copy of the served model: `tp` GPUs of `acc`, how a step takes its time, the scheduler's limits."""

    acc: Accelerator
    tp: int
    step: Any  # a simulate.StepTime
    limits: Limits
    engine: str
    weight_bytes: float  # per GPU
    kv_bytes_per_token: float  # per GPU
    source: str  # where the step times come from
    request_s: float = 0.0  # a request's time outside the steps (HTTP, tokenizing): measured on a CPU

    @property
    def gpus(self) -> int:
        return self.tp


def kv_value_bytes(precision: str) -> int:
    """A cached key's or value's bytes: the weights' precision, and 16 bits under FP8 weights (vLLM's
    kv_cache_dtype "auto" keeps the activations' dtype)."""
    return 2 if precision == "fp8" else BYTES[precision]


def gpu_replica(
    model: ModelSpec,
    acc: Accelerator,
    precision: str,
    tp: int,
    efficiency: float | None = None,
    kv_precision: str | None = None,
) -> Replica | None:
    """vLLM on `tp` GPUs of `acc`, or None where the weights leave no room for a KV cache, or the accelerator
    has no peak at the precision. `kv_precision` (default: kv_value_bytes) for an engine told to cache in fp8."""
    peak = acc.peak_tflops(precision)
    if not peak:
        return None
    weights = model.params * BYTES[precision] / tp
    value = BYTES[kv_precision] if kv_precision else kv_value_bytes(precision)
    per_token = kv_bytes_per_token(model.layers, model.kv_heads, model.head_dim, value, tp)
    room = acc.mem_bytes * GPU_MEMORY_UTILIZATION - weights - OVERHEAD_BYTES.value
    max_seqs, budget, why = vllm_scheduler(acc.mem_bytes, acc.name)
    if room <= 0:
        return None
    eff = efficiency if efficiency is not None else SERVE_EFFICIENCY.value
    step = Roofline(
        weight_bytes=weights,
        kv_bytes_per_token=per_token,
        flops_per_token=2 * model.compute_params / tp,
        pair_flops=4 * model.layers * model.heads * model.head_dim / tp,
        flops_per_s=peak * 1e12 * eff,
        bytes_per_s=acc.mem_bw_gbs * 1e9 * BANDWIDTH_EFFICIENCY.value,
        overhead_s=STEP_OVERHEAD.value + (2 * model.layers * ALLREDUCE_S.value if tp > 1 else 0.0),
    )
    limits = Limits(max_seqs=max_seqs, token_budget=budget, kv_tokens=int(room // per_token))
    source = f"{acc.name} peaks (catalog) x {eff:.0%} compute, {BANDWIDTH_EFFICIENCY.value:.0%} bandwidth; {why}"
    return Replica(acc, tp, step, limits, "vllm", weights, per_token, source)


@dataclass
class Load:
    """One replica's simulated serving at one arrival rate."""

    rate: float
    outcome: Outcome
    targets: Targets

    @property
    def attainment(self) -> float:
        return self.outcome.attainment(self.targets.ttft, self.targets.tpot)

    def point(self) -> dict[str, Any]:
        o, q = self.outcome, self.targets.percentile
        return {
            "rate": self.rate,
            "ttft_p50": percentile(o.ttft, 50),
            f"ttft_p{q:g}": percentile(o.ttft, q),
            "tpot_p50": percentile(o.tpot, 50),
            f"tpot_p{q:g}": percentile(o.tpot, q),
            "throughput": o.throughput,
            "attainment": self.attainment,
            "overloaded": o.overloaded,
        }


def run_at(replica: Replica, traffic: Traffic, targets: Targets, rate: float, n: int = REQUESTS) -> Load:
    reqs = poisson(rate, n, traffic.prompt_tokens, traffic.output_tokens, seed=0)
    return Load(rate, simulate(replica.step, replica.limits, reqs, request_s=replica.request_s), targets)


def saturation_rate(replica: Replica, traffic: Traffic) -> float:
    """Requests a second the replica finishes with every slot busy: an upper bound on its goodput."""
    p, o = traffic.prompt_tokens, traffic.output_tokens
    rows = max(1, min(replica.limits.max_seqs, replica.limits.kv_tokens // (p + o)))
    ctx = rows * (p + o / 2)
    decode = replica.step.seconds(rows, ctx, ctx, rows)
    prefill = replica.step.seconds(p, p, p * p / 2, 1) - replica.step.seconds(0, 0, 0, 0)
    return rows / (o * decode + rows * prefill)


@dataclass
class Goodput:
    rate: float  # requests/s one replica serves within the targets (0: not even one request alone)
    binds: str  # what stops it going higher
    curve: list[dict[str, Any]] = field(default_factory=list)
    alone: Load | None = None


def goodput(replica: Replica, traffic: Traffic, targets: Targets, n: int = REQUESTS) -> Goodput:
    """The highest rate at which `targets.share` of requests meet both targets, by bisection over simulations
    with the same arrivals scaled (so the attainment falls with the rate, no noise between rates)."""
    alone = run_at(replica, traffic, targets, rate=1e-6, n=3)  # one at a time: the best latency the replica gives
    ttft1, tpot1 = max(alone.outcome.ttft), max(alone.outcome.tpot)
    if ttft1 > targets.ttft or tpot1 > targets.tpot:
        which = "TTFT" if ttft1 / targets.ttft >= tpot1 / targets.tpot else "TPOT"
        return Goodput(0.0, f"{which} of one request alone", [alone.point()], alone)
    hi = 1.5 * saturation_rate(replica, traffic)
    lo = 0.0
    loads = {}
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        loads[mid] = load = run_at(replica, traffic, targets, mid, n)
        if load.attainment >= targets.share:
            lo = mid
        else:
            hi = mid
    above = loads.get(hi) or run_at(replica, traffic, targets, hi, n)
    # the curve: below the knee, at it, and past it (where latency climbs), so the knee shows
    curve = [run_at(replica, traffic, targets, f * lo, n).point() for f in (0.25, 0.5, 0.75, 0.9) if lo > 0] + [
        loads[lo].point() if lo in loads else None,
        above.point(),
        *(run_at(replica, traffic, targets, f * lo, n).point() for f in (1.1, 1.25) if lo > 0 and f * lo > hi),
    ]
    return Goodput(lo, binds(above, targets, replica), [c for c in curve if c], alone)


def binds(load: Load, targets: Targets, replica: Replica) -> str:
    """What fails first just past the goodput: the KV cache (requests wait for room or are preempted), the
    sequence limit, or one of the targets, with whether the steps there are compute- or bandwidth-bound."""
    o = load.outcome
    if o.preemptions or o.kv_waits:
        return "KV memory"
    if o.seq_waits:
        return f"max sequences ({replica.limits.max_seqs})"
    q = targets.percentile
    ttft, tpot = percentile(o.ttft, q) / targets.ttft, percentile(o.tpot, q) / targets.tpot
    which = "TTFT" if o.overloaded or ttft >= tpot else "TPOT"
    return which + (" (compute)" if o.steps and o.compute_steps / o.steps > 0.5 else "")


def hours_per_month(hours_per_day: float) -> float:
    return hours_per_day * HOURS_PER_MONTH_DAY


def option_costs(catalog: Catalog, acc: Accelerator, gpus: int, hours_day: float) -> list[dict[str, Any]]:
    """$/hour and $/month of `gpus` GPUs up `hours_day` a day: each cloud price, and owning them (the purchase
    over its life, whether the GPUs are up or not, plus power while up)."""
    hours = hours_per_month(hours_day)
    rows = [
        {
            "provider": p.provider,
            "usd_per_hour": gpus * p.usd_per_gpu_hour,
            "usd_per_month": gpus * p.usd_per_gpu_hour * hours,
            "kind": p.kind,
            "as_of": p.as_of,
            "source": p.source,
        }
        for p in catalog.prices(acc.slug)
    ]
    price = catalog.purchase_price(acc.slug)
    if price is not None:
        capex_month = gpus * price.usd_per_gpu / (LIFE_YEARS.value * 12)
        kw = gpus * (acc.tdp_w or 0) / 1000 * HOST_POWER.value * PUE.value
        power_month = kw * KWH_USD.value * hours
        rows.append(
            {
                "provider": "on-prem",
                "usd_per_hour": (capex_month + power_month) / hours,
                "usd_per_month": capex_month + power_month,
                "kind": f"bought ({price.item}), {LIFE_YEARS.value:g} years, power while up",
                "as_of": price.as_of,
                "source": price.source,
            }
        )
    return sorted(rows, key=lambda r: r["usd_per_month"])


def output_tokens_per_month(traffic: Traffic, hours_day: float) -> float:
    return traffic.rps * traffic.output_tokens * 3600 * hours_per_month(hours_day)


def api_cost(price: HostedPrice, traffic: Traffic, hours_day: float) -> float:
    """$/month of the traffic on a hosted API."""
    requests = traffic.rps * 3600 * hours_per_month(hours_day)
    return requests * (traffic.prompt_tokens * price.usd_in + traffic.output_tokens * price.usd_out) / 1e6


def breakeven_rps(
    per_replica_month: float, replica_goodput: float, price: HostedPrice, traffic: Traffic, hours_day: float
) -> float | None:
    """The traffic above which the GPUs cost less a month than the API: one replica's cost over the API's cost
    of one request a second. None where even a full replica costs more per request than the API."""
    per_rps = api_cost(price, Traffic(1.0, traffic.prompt_tokens, traffic.output_tokens, ""), hours_day)
    r = per_replica_month / per_rps
    return r if r <= replica_goodput else None


def tp_choices(model: ModelSpec, acc: Accelerator) -> list[int]:
    return [t for t in (1, 2, 4, 8, 16) if t <= acc.max_per_node and model.heads % t == 0]


def gpu_candidates(
    model: ModelSpec, acc: Accelerator, precision: str, efficiency: float | None, need: int
) -> tuple[list[Replica], str]:
    """vLLM replicas of `acc` at each tensor-parallel degree that holds a request of `need` tokens; and why
    there are none, where there are none."""
    if not acc.peak_tflops(precision):
        return [], f"no {precision} peak in the catalog"
    out, why = [], ""
    for tp in tp_choices(model, acc):
        replica = gpu_replica(model, acc, precision, tp, efficiency)
        if replica is None or replica.limits.kv_tokens < need:
            why = f"the weights and one request's {need:,} tokens of KV cache do not fit on {tp} GPU(s)"
            continue
        out.append(replica)
    return out, why


def plan_option(
    acc: Accelerator,
    candidates: list[Replica],
    why: str,
    traffic: Traffic,
    targets: Targets,
    catalog: Catalog,
    hours_day: float,
    label: str | None = None,
) -> dict[str, Any]:
    """One accelerator's answer: of its `candidates` (tensor-parallel degrees, smallest first), the cheapest of
    the first two that meet the targets (three tried at most), its replicas, latency at the traffic, cost and
    curve; or `why` none does."""
    tried: list[tuple[float, Replica, Goodput]] = []
    for replica in candidates:
        g = goodput(replica, traffic, targets)
        if g.rate <= 0:
            why = (
                f"TP {replica.tp}: {g.binds} misses the targets" if replica.tp > 1 else f"{g.binds} misses the targets"
            )
            tried.append((math.inf, replica, g))
        else:
            tried.append((math.ceil(traffic.rps / g.rate) * replica.tp, replica, g))
        if len([t for t in tried if t[0] < math.inf]) >= 2 or len(tried) >= 3:
            break
    base = {"gpu": label or acc.slug, "gpu_name": acc.name, "kind": acc.kind}
    meets = [t for t in tried if t[0] < math.inf]
    if not meets:
        last = tried[-1] if tried else None
        return base | {
            "meets": False,
            "slow_link": False,
            "why": why,
            "alone": last[2].alone.point() if last and last[2].alone else None,
        }
    most, replica, g = min(meets, key=lambda t: (t[0], t[1].tp))
    gpus = int(most)
    replicas = gpus // replica.tp
    at = run_at(replica, traffic, targets, traffic.rps / replicas)
    costs = option_costs(catalog, acc, gpus, hours_day)
    tokens = output_tokens_per_month(traffic, hours_day)
    per_replica = costs[0]["usd_per_month"] / replicas if costs else None
    q = targets.percentile
    return base | {
        "meets": True,
        "slow_link": replica.tp > acc.nvlink_domain,
        "engine": replica.engine,
        "tp": replica.tp,
        "replicas": replicas,
        "gpus": gpus,
        "concurrency": at.outcome.peak_running,
        "max_seqs": replica.limits.max_seqs,
        "kv_tokens": replica.limits.kv_tokens,
        "goodput_per_replica": g.rate,
        "binds": g.binds,
        "at_traffic": at.point(),
        f"ttft_p{q:g}": percentile(at.outcome.ttft, q),
        f"tpot_p{q:g}": percentile(at.outcome.tpot, q),
        "costs": costs,
        "usd_per_hour": costs[0]["usd_per_hour"] if costs else None,
        "usd_per_month": costs[0]["usd_per_month"] if costs else None,
        "cheapest_provider": costs[0]["provider"] if costs else None,
        "usd_per_m_output": costs[0]["usd_per_month"] / tokens * 1e6 if costs else None,
        "per_replica_month": per_replica,
        "curve": g.curve,
        "step_source": replica.source,
    }


def capacity_plan(
    model: ModelSpec,
    traffic: Traffic,
    targets: Targets,
    catalog: Catalog,
    precision: str = "bf16",
    hours_day: float = 24,
    gpu: str | None = None,
    efficiency: float | None = None,
    measured: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Every accelerator's option (or `gpu`'s; "cpu": this machine's), the cheapest that meets the targets
    starred, and the hosted APIs beside them. `measured`: this machine's `gpuwise bench --serve` records of
    the model, one option each."""
    if not model.causal:
        raise GpuwiseError(f"{model.name} is an encoder ({model.family}): it generates no tokens to serve")
    if traffic.prompt_tokens + traffic.output_tokens > model.max_seq > 0:
        raise GpuwiseError(
            f"--prompt-tokens + --output-tokens = {traffic.prompt_tokens + traffic.output_tokens:,} is longer than "
            f"{model.name}'s context of {model.max_seq:,} tokens"
        )
    need = traffic.prompt_tokens + traffic.output_tokens
    options = []
    if gpu != "cpu":
        accs = [catalog.get(gpu)] if gpu else [a for a in catalog.accelerators.values() if a.kind == "gpu"]
        for a in accs:
            candidates, why = gpu_candidates(model, a, precision, efficiency, need)
            options.append(plan_option(a, candidates, why, traffic, targets, catalog, hours_day))
    if gpu in (None, "cpu"):
        options += cpu_options(model, traffic, targets, catalog, hours_day, measured)
    # Tensor parallel over PCIe: its all-reduces cost far more than the NVLink latency priced here, so such an
    # option ranks after every other (as `gpuwise plan` ranks them) and is starred only where nothing else meets.
    priced = [o for o in options if o["meets"] and o["usd_per_month"] is not None]
    best = min(priced, key=lambda o: (o["slow_link"], o["usd_per_month"])) if priced else None
    for o in options:
        o["cheapest"] = o is best
    options.sort(
        key=lambda o: (not o["meets"], o["slow_link"], o.get("usd_per_month") is None, o.get("usd_per_month") or 0)
    )
    apis = hosted_prices(model.name)
    hosted = []
    for p in apis:
        row = {**p.as_dict(), "usd_per_month": api_cost(p, traffic, hours_day)}
        if best is not None:
            row["breakeven_rps"] = breakeven_rps(
                best["per_replica_month"], best["goodput_per_replica"], p, traffic, hours_day
            )
        hosted.append(row)
    closed = [{**p.as_dict(), "usd_per_month": api_cost(p, traffic, hours_day)} for p in hosted_prices("closed")]
    return {
        "model": {"name": model.name, "params": model.params, "source": model.source},
        "task": "serve",
        "precision": precision,
        "traffic": traffic.as_dict(),
        "targets": targets.as_dict(),
        "hours_per_day": hours_day,
        "hours_per_month": hours_per_month(hours_day),
        "output_tokens_per_month": output_tokens_per_month(traffic, hours_day),
        "recommended": best["gpu"] if best else None,
        "options": options,
        "hosted": sorted(hosted, key=lambda r: r["usd_per_month"]),
        "closed": sorted(closed, key=lambda r: r["usd_per_month"]),
        "assumptions": [
            a.origin
            for a in (
                STEP_OVERHEAD,
                ALLREDUCE_S,
                SERVE_EFFICIENCY,
                BANDWIDTH_EFFICIENCY,
                OVERHEAD_BYTES,
                LIFE_YEARS,
                KWH_USD,
                PUE,
                HOST_POWER,
            )
        ]
        + [
            "tensor parallel over PCIe (marked) is priced at NVLink's all-reduce latency: too fast, ranked last",
            "every request has the profile's (or the given) prompt and output lengths; arrivals are Poisson at the "
            "busy-hour rate, which holds every hour the endpoint is up",
            f"vLLM's scheduler (max_num_seqs, max_num_batched_tokens: its defaults) and "
            f"{GPU_MEMORY_UTILIZATION:.0%} of GPU memory for weights and KV cache",
        ],
    }


def cpu_options(
    model: ModelSpec,
    traffic: Traffic,
    targets: Targets,
    catalog: Catalog,
    hours_day: float,
    measured: list[dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    """This machine's options: one for each engine `gpuwise bench --serve` measured the model on here; or one
    that says how to measure it."""
    # here, not at the top: the catalog's GPUs plan without detecting this machine
    from gpuwise.hardware.devices import here

    acc, _ = here(catalog)
    if acc.kind != "cpu":
        return []
    if not measured:
        why = f"not measured here: run `gpuwise bench --serve {model.name}` to measure this CPU's engine"
        return [plan_option(acc, [], why, traffic, targets, catalog, hours_day, label="cpu")]
    need = traffic.prompt_tokens + traffic.output_tokens
    out = []
    for fit in measured:
        replica = measured_replica(model, acc, fit)
        label = f"cpu ({fit['engine']})"
        if replica.limits.kv_tokens < need or need > fit.get("context", need):
            why = f"a request's {need:,} tokens exceed what the engine was measured to hold"
            out.append(plan_option(acc, [], why, traffic, targets, catalog, hours_day, label=label))
        else:
            out.append(plan_option(acc, [replica], "", traffic, targets, catalog, hours_day, label=label))
    return out


def measured_replica(model: ModelSpec, acc: Accelerator, fit: dict[str, Any]) -> Replica:
    """A replica of this machine from a `gpuwise bench --serve` record's data: its fitted step and the limits
    the engine was measured under."""
    f, lim = fit["fit"], fit["limits"]
    step = Fitted(f["a"], f["b"], f["c"], f["d"], f.get("e", 0.0))
    limits = Limits(
        max_seqs=lim["max_seqs"],
        token_budget=lim["token_budget"],
        kv_tokens=lim["kv_tokens"],
        chunk_ratio=lim.get("chunk_ratio", 0.0),
        solo_chunk_s=lim.get("solo_chunk_s", 0.0),
    )
    source = (
        f"measured by gpuwise bench --serve on {fit['host']} ({fit['engine']}, {_held(fit)}, record #{fit['id']})"
    )
    return Replica(acc, 1, step, limits, fit["engine"], 0.0, 0.0, source, request_s=f["request_s"])


def _held(fit: dict[str, Any]) -> str:
    """What a measured server computed in and held: its --dtype, and its weights where they differ."""
    weights = fit.get("weights")
    return fit["dtype"] if not weights or weights == fit["dtype"] else f"{fit['dtype']}, weights {weights}"
