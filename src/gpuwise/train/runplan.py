"""The plan a training run is compared with, made once before its first step: one real forward and
backward counts the FLOPs and the activations saved for backward, the micro-batch is fitted to memory, and
memory and step time are planned the way `gpuwise plan` plans them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuwise.errors import first_line
from gpuwise.train import fit, measure
from gpuwise.train.rng import rng_state, set_rng_state
from gpuwise.train.setup import Run, say


@dataclass(frozen=True)
class RunPlan:
    """The run's plan: the micro-batch it starts with, the figures its summary sets beside what it measures
    (`figures`: peak_bytes, step_time_s, ..., method), and the device's peak they are reckoned from."""

    micro: int
    figures: dict[str, Any]
    flops_per_step: float
    peak: float | None
    peak_origin: str
    device_key: str


def plan_run(run: Run, micro: int | None, step: int, forward_backward: Callable[[int, int], float]) -> RunPlan:
    """Measure one step (FLOPs, activations saved for backward), fit the micro-batch to memory unless it is
    given (`micro`: --micro-batch-size, or a resumed run's), on CUDA with a real probe step of
    `forward_backward(step, micro)`; and plan the run's memory and step time."""
    lay, fabric, work, raw = run.layout, run.fabric, run.work, run.raw
    rng = rng_state()
    probe_n = min(lay.share, 4)
    probe_batch = fabric.to_device(work.make_batch(list(range(probe_n)), 0))
    if lay.precision == "bf16-true":
        # bf16 weights: the raw module skips the input conversion Fabric's wrapper does
        probe_batch = fabric.strategy.precision.convert_input(probe_batch)
    flops, saved = measure.probe_step(raw, work.loss, probe_batch)
    flops_per_sample, saved_per_sample = flops / probe_n, saved / probe_n
    states = measure.state_bytes(raw)

    def estimate(m: int) -> float:
        return states + saved_per_sample * m

    if micro is None:
        budget = fit.available_bytes(lay.accelerator, fabric.local_rank if lay.accelerator == "cuda" else 0)
        micro = fit.largest_fitting(lay.share, estimate, int(budget * 0.9) if budget else None)
        if lay.accelerator == "cuda":

            def probe(m: int) -> None:
                forward_backward(step, m)
                run.optimizer.zero_grad(set_to_none=True)

            micro = fit.probe(micro, probe)
    micro = min(micro, lay.share)
    set_rng_state(rng)
    peak, peak_origin = measure.peak_flops(lay.accelerator, lay.precision, fabric.local_rank)
    flops_per_step = flops_per_sample * lay.batch_size
    device_key = measure.device_key(lay.accelerator, fabric.local_rank)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    figures: dict = {"peak_bytes": int(estimate(micro))}
    figures |= measure.step_time_plan(
        device_key,
        lay.cfg.workload,
        lay.precision,
        flops_per_step,
        peak,
        lay.world,
        lay.share,
        trainable,
        lambda: work.make_batch(list(range(lay.share)), 0),
    )
    time_method = figures.pop("time_method")
    memory_method = "model states + activations saved for backward, counted on one micro-batch"
    if work.model_spec is not None:
        analytic = analytic_plan(work, lay.cfg, micro, lay.precision, raw)
        figures["peak_bytes"], memory_method = analytic["peak_bytes"], analytic["method"]
    elif lay.strategy != "fsdp":  # FSDP's shards are traced by `gpuwise plan --traced --gpus N`, not here
        traced = traced_plan_bytes(raw, work, fabric, micro, lay.precision)
        if traced:
            figures["peak_bytes"], memory_method = traced, f"traced on fake tensors: one step at micro-batch {micro}"
    figures["method"] = f"memory: {memory_method}; time = {time_method}"
    return RunPlan(micro, figures, flops_per_step, peak, peak_origin, device_key)


def traced_plan_bytes(raw, work, fabric, micro: int, precision: str) -> int | None:
    """Peak tensor bytes of one step of the run's own model, traced on fake tensors (plan/traced.py), on a
    real batch of the micro-batch's size; None where tracing fails (say, an op with no fake-tensor kernel),
    and the saved-activation estimate stands."""
    from gpuwise.plan.traced import traced_run_memory

    rng = rng_state()  # the traced step must not move the run's random streams
    batch = fabric.to_device(work.make_batch(list(range(micro)), 0))
    low = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
    device = next(raw.parameters()).device.type
    try:
        return traced_run_memory(raw, work.loss, batch, low, device)
    except Exception as e:  # noqa: BLE001 - a user's model: any failure falls back to the estimate
        say(fabric, f"gpuwise: tracing the step failed ({first_line(e)}); memory planned from saved activations")
        return None
    finally:
        set_rng_state(rng)


def analytic_plan(work, cfg, micro: int, precision: str, raw) -> dict:
    """For transformer workloads: `gpuwise plan`'s analytic activations, with the states of the model as this
    run holds them. `gpuwise plan` counts mixed precision as Megatron keeps it (16-bit weights and gradients,
    fp32 master weights and moments: 16 bytes a parameter); Fabric's autocast keeps fp32 weights and
    gradients, the moments, and a 16-bit copy of each matrix a product reads, alive from forward to backward
    (18), which is what this counts."""
    from gpuwise.plan.memory import memory
    from gpuwise.plan.request import Layout, PlanRequest

    task = {"full": "finetune"}.get(cfg.method, cfg.method)
    req = PlanRequest(
        task=task,
        batch=micro,
        seq=cfg.block_size,
        precision="fp32" if precision == "32-true" else "bf16",
        lora_rank=cfg.lora_rank if task != "finetune" else None,
        checkpointing="none",
    )
    mem = memory(work.model_spec, req, Layout())
    casts = 0
    if precision in ("bf16-mixed", "16-mixed"):
        matrices = {id(m.weight): m.weight for m in raw.modules() if isinstance(m, torch.nn.Linear)}
        casts = 2 * sum(w.numel() for w in matrices.values() if w.dtype == torch.float32)
    # The step's peak falls in the loss's backward: the gradient of the logits (fp32, and 16-bit under
    # autocast) exists beside everything forward saved. In fp32 the formula's fp32 upcast of the logits is
    # no copy, and those 4 bytes stand for the gradient's (docs/benchmarks.md has the figures behind both).
    logit_grads = cfg.block_size * micro * work.model_spec.vocab * (6 if req.precision == "bf16" else 0)
    # Not every weight's gradient is alive at that peak: backward makes each layer's as it frees that layer's
    # activations, so as it starts only the output layer's exists. The end of backward (every gradient, no
    # activations) is the other candidate.
    states = measure.state_bytes(raw)
    grads = sum(p.numel() * p.element_size() for p in raw.parameters() if p.requires_grad)
    head = raw.get_output_embeddings() if hasattr(raw, "get_output_embeddings") else None
    head_grad = (
        head.weight.numel() * head.weight.element_size() if head is not None and head.weight.requires_grad else 0
    )
    peak = max(states - grads + head_grad + mem.activations + casts + logit_grads, states)
    return {"peak_bytes": int(peak), "method": "this model's states + gpuwise plan's analytic activations (tensors)"}
