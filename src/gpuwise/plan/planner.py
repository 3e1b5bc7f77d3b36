"""One plan (a model x task on N of one accelerator) and the sweep over the whole catalog."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.hardware.reference import GiB
from gpuwise.plan import advice
from gpuwise.plan.compute import Compute, compute
from gpuwise.plan.cost import check_provider, cloud_costs, onprem_cost
from gpuwise.plan.engines import serving_plan
from gpuwise.plan.memory import BYTES, Memory, memory, trainable_params
from gpuwise.plan.model import ModelSpec, resolve_model
from gpuwise.plan.request import Layout, PlanRequest, check_flags, validate
from gpuwise.results import PlanResult
from gpuwise.runs import db

MAX_BATCH = 4096


@dataclass
class Plan:
    model: ModelSpec
    req: PlanRequest
    acc: Accelerator
    layout: Layout
    mem: Memory
    fits: bool
    why: str
    max_batch: int  # the largest batch that fits (0: not even batch 1)
    compute: Compute | None
    cost: list[dict]
    onprem: dict | None
    warnings: list[str] = field(default_factory=list)

    @property
    def cheapest_usd(self) -> float | None:
        usd = [c["usd"] for c in self.cost] or ([self.onprem["usd"]] if self.onprem else [])
        return min(usd) if usd else None

    def as_dict(self) -> dict[str, Any]:
        """The option's fields of a PlanResult, by their JSON names."""
        m = self.model
        return {
            "model": {"name": m.name, "family": m.family, "params": m.params, "published_params": m.published_params},
            "task": self.req.task,
            "gpu": self.acc.slug,
            "gpu_name": self.acc.name,
            "gpus": self.layout.gpus,
            "layout": {
                "dp": self.layout.dp,
                "tp": self.layout.tp,
                "pp": self.layout.pp,
                "zero": self.layout.zero,
                "text": self.layout.describe(),
            },
            "precision": self.req.precision,
            "batch": self.req.batch,
            "seq": self.req.seq,
            "memory": self.mem.as_dict(),
            "capacity": self.acc.mem_bytes,
            "fits": self.fits,
            "why": self.why,
            "max_batch": self.max_batch,
            "kv_cache_per_token": int(m.kv_cache_per_token(BYTES[self.req.precision])),
            "trainable_params": trainable_params(m, self.req),
            "compute": self.compute.as_dict() if self.compute else None,
            "cost": self.cost,
            "onprem": self.onprem,
            "warnings": self.warnings,
        }


def _fits(model: ModelSpec, req: PlanRequest, acc: Accelerator, layout: Layout) -> bool:
    return memory(model, req, layout).total <= acc.mem_bytes


def max_batch(model: ModelSpec, req: PlanRequest, acc: Accelerator, layout: Layout) -> int:
    """Memory grows monotonically with the batch: bisect for the largest that fits."""
    if not _fits(model, req.with_batch(1), acc, layout):
        return 0
    lo, hi = 1, MAX_BATCH
    if _fits(model, req.with_batch(hi), acc, layout):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(model, req.with_batch(mid), acc, layout) else (lo, mid)
    return lo


def plan_one(model: ModelSpec, req: PlanRequest, acc: Accelerator, layout: Layout, catalog: Catalog) -> Plan:
    mem = memory(model, req, layout)
    comp = compute(model, req, acc, layout, mem, catalog.calibration.get((acc.slug, f"matmul.{req.precision}")))
    cap = acc.mem_bytes
    if comp is None:
        fits, why = (
            False,
            f"no dense {req.precision} peak for {acc.name} in the catalog"
            + (" (no bf16 before Ampere: use --precision fp16)" if req.precision == "bf16" and acc.fp16_tflops else ""),
        )
    elif mem.total <= cap:
        fits, why = True, f"fits: {mem.total / GiB:.1f} of {cap / GiB:.0f} GiB per GPU ({1 - mem.total / cap:.0%} free)"
    else:
        parts = {
            "weights": mem.weights,
            "activations": mem.activations,
            "optimizer": mem.optimizer,
            "KV cache": mem.kv_cache,
            "gradients": mem.gradients,
        }
        big = max(parts, key=parts.__getitem__)
        fits, why = (
            False,
            (f"needs {mem.total / GiB:.1f} GiB per GPU, has {cap / GiB:.0f} ({big} {parts[big] / GiB:.1f} GiB)"),
        )
    gpu_hours = comp.gpu_hours if comp else 0.0
    cost = cloud_costs(catalog, acc, gpu_hours, req.provider) if comp else []
    cheapest = min((c["usd_per_gpu_hour"] for c in cost), default=None)
    onprem = onprem_cost(catalog, acc, gpu_hours, req, cheapest) if comp else None
    plan = Plan(
        model, req, acc, layout, mem, fits, why, max_batch(model, req, acc, layout) if comp else 0, comp, cost, onprem
    )
    plan.warnings = advice.option_warnings(plan)
    return plan


def _counts(acc: Accelerator, training: bool) -> list[int]:
    node = acc.max_per_node
    small = [c for c in (1, 2, 4, 8, 16) if c <= node]
    top = 4096 if training else 64
    big, c = [], node * 2
    while c <= top:
        big.append(c)
        c *= 2
    return small + big


def _layouts(model: ModelSpec, req: PlanRequest, acc: Accelerator, gpus: int) -> list[Layout]:
    """Layouts to try for a GPU count, most common first; the user's --tp/--pp/--zero are kept."""
    if req.tp or req.pp or req.zero is not None:
        tp, pp = req.tp or 1, req.pp or 1
        if gpus % (tp * pp):
            return []
        dp = gpus // (tp * pp)
        zero = req.zero if req.zero is not None else (3 if req.training and dp > 1 else 0)
        return [Layout(gpus, tp, pp, zero)]
    node = acc.max_per_node
    tps = [t for t in (1, 2, 4, 8, 16) if t <= min(gpus, node) and model.heads % t == 0]
    if not req.training:
        tp = tps[-1]  # serving shards one replica over the node's GPUs
        if gpus % tp:
            return []
        # ... and pipelines it over the rest, but a stage holds at least one layer: GPUs beyond that
        # serve further replicas side by side (data parallel), never stages with nothing in them.
        rest = gpus // tp
        pp = next(p for p in range(min(rest, model.layers), 0, -1) if rest % p == 0)
        return [Layout(gpus, tp, pp, 0)]
    return [Layout(gpus, t, 1, 3 if gpus // t > 1 else 0) for t in tps]


def plan_accelerator(model: ModelSpec, req: PlanRequest, acc: Accelerator, catalog: Catalog) -> Plan:
    """At --gpus if given, else at the smallest count (and simplest layout) that fits."""
    counts = [req.gpus] if req.gpus else _counts(acc, req.training)
    tried = None
    if acc.peak_tflops(req.precision):
        for gpus in counts:
            for layout in _layouts(model, req, acc, gpus):
                # One memory evaluation per candidate; the full plan only for the one we keep.
                if _fits(model, req, acc, layout):
                    return plan_one(model, req, acc, layout, catalog)
                tried = layout
    plan = plan_one(model, req, acc, tried or Layout(counts[0]), catalog)
    if tried and not req.gpus:
        plan.why = f"does not fit on up to {tried.gpus} GPUs: " + plan.why
    return plan


def _slow_link(p: Plan) -> bool:
    return p.layout.tp > p.acc.nvlink_domain


def _sort_key(p: Plan):
    """Fitting first; then clean layouts before tensor parallel over PCIe (its time estimate is too
    optimistic to compete on price or speed); then the cheapest; then the fastest."""
    usd = p.cheapest_usd
    return (not p.fits, _slow_link(p), usd is None, usd or 0.0, p.compute.wall_hours if p.compute else 0.0)


def _demoted(p: Plan) -> str | None:
    """Why `_sort_key` puts a fitting option below the price order, in words; None where it does not."""
    if not p.fits:
        return None
    if _slow_link(p):
        return f"tensor parallel over PCIe (TP{p.layout.tp} beyond NVLink's {p.acc.nvlink_domain}): time too optimistic"
    if p.cheapest_usd is None:
        return "no price in the catalog"
    return None


def build_plan(model: ModelSpec, req: PlanRequest, catalog: Catalog) -> PlanResult:
    """The whole answer: the recommended plan's fields at the top, every option under "options"."""
    validate(req, model)
    check_provider(catalog, req.provider)
    if req.gpu:
        accs = [catalog.get(req.gpu)]
    else:
        accs = [a for a in catalog.accelerators.values() if a.kind != "cpu"]
    options = sorted((plan_accelerator(model, req, a, catalog) for a in accs), key=_sort_key)
    best = options[0]
    fitting = [o for o in options if o.fits and o.compute and not _slow_link(o)]
    # `fitting` holds only plans with a compute estimate; the else is for the type checker.
    fastest = min(fitting, key=lambda o: o.compute.wall_hours if o.compute else float("inf")) if fitting else None
    return PlanResult.build(
        best.as_dict()
        | {
            "recommended": best.fits,
            "warnings": advice.plan_warnings(model, req, options, catalog) + best.warnings,
            "assumptions": advice.assumptions_used(req, best),
            "options": [
                o.as_dict() | {"cheapest": o is best and o.fits, "fastest": o is fastest, "demoted": _demoted(o)}
                for o in options
            ],
        }
    )


def make_plan(model: ModelSpec, req: PlanRequest, catalog: Catalog) -> dict[str, Any]:
    """`build_plan` as the JSON object `plan --json` prints and the run record keeps."""
    return build_plan(model, req, catalog).dump()


def plan_for(model: str, req: PlanRequest, catalog: Catalog) -> tuple[dict[str, Any], str | None]:
    """What `gpuwise plan --model MODEL` answers, and `gpuwise ui`'s plan page: the plan with this machine's
    bench calibration; and a warning when the run record could not be read for it (the plan is then made
    without the calibration)."""
    check_flags(req)  # before the model is read: the cheapest mistakes first
    warning = None
    try:
        catalog.calibration = db.calibration_map()
    except GpuwiseError as e:
        # The record only refines the efficiency: a broken one must not cost the user the plan.
        warning = f"planning without bench calibration: {e}"
    spec = resolve_model(model)
    result = make_plan(spec, req, catalog)
    if req.task == "inference" and result.get("fits"):  # how `gpuwise serve` would serve it there
        kind = catalog.get(result["gpu"]).kind
        result["serving"] = serving_plan(result, model, spec.source, req.gen or 0, kind)
    return result, warning
