"""The plan of a training run: its memory (`plan_memory`) and its step time (`plan_step`), the one rule that
`gpuwise train` runs before its first step (`plan_run`, which also fits the micro-batch to memory) and `gpuwise
launch` runs for the job it writes. One forward and backward counts the FLOPs and the activations saved for
backward; memory and step time are planned the way `gpuwise plan` plans them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpuwise.errors import first_line
from gpuwise.plan.memory import memory
from gpuwise.plan.request import Layout, PlanRequest
from gpuwise.plan.traced import traced_run_memory
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


@dataclass(frozen=True)
class Probe:
    """What one forward and backward on a few samples counted: FLOPs a sample, bytes autograd saves a sample,
    and the model's states (weights, gradients, AdamW moments)."""

    flops_per_sample: float
    saved_per_sample: float
    states: int

    def estimate(self, micro: int) -> float:
        """States + saved activations at a micro-batch: what fitting the micro-batch weighs."""
        return self.states + self.saved_per_sample * micro


@dataclass(frozen=True)
class MemoryPlan:
    """The memory one process of a run holds at its peak (tensors: no CUDA context) and how it was planned."""

    peak_bytes: int
    method: str


def probe(model, loss: Callable, make_batch: Callable[[int], dict], share: int) -> Probe:
    """One forward and backward on min(share, 4) samples of `make_batch(n)` (where the model is), counted
    (train/measure.py probe_step); a model on fake tensors under its fake mode. The random streams are left
    as they were."""
    rng = rng_state()  # outside a fake mode: the random streams are real tensors
    n = min(share, 4)
    with _fake_mode(model) or contextlib.nullcontext():
        flops, saved = measure.probe_step(model, loss, make_batch(n))
    set_rng_state(rng)
    return Probe(flops / n, saved / n, measure.state_bytes(model))


def plan_memory(
    model,
    loss: Callable,
    make_batch: Callable[[int], dict],
    probed: Probe,
    cfg,
    micro: int,
    precision: str,
    world: int,
    fsdp: bool,
    model_spec=None,
    say_failure: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """The one rule for a training run's memory, which `gpuwise train` runs before its first step and `gpuwise
    launch` for the job it writes (`precision` is Fabric's: bf16-mixed, 32-true...). A model built on fake
    tensors (`Workload.plan_build`) is planned the same way, under its fake mode: nothing is allocated.

    - A transformer the analytic formulas describe (`model_spec`): its states + their activations.
    - Else, unless sharded: one step at the micro-batch traced on fake tensors (plan/traced.py); where tracing
      fails, the states + the bytes the probe saw saved, at the micro-batch.
    - FSDP: those, with the states (weights, gradients, AdamW moments) sharded over the `world` processes;
      a sharded model is not traced."""
    tensors = probed.estimate(micro)
    method = "model states + activations saved for backward, counted on one step of a few samples"
    if model_spec is not None:  # shapes and dtypes only: a fake model's are its own
        tensors = analytic_plan(model_spec, cfg, micro, precision, model)
        method = "this model's states + gpuwise plan's analytic activations (tensors)"
    elif not fsdp:
        rng = rng_state()  # the traced step must not move the run's random streams
        traced = _traced(model, loss, make_batch(micro), precision, say_failure)
        set_rng_state(rng)
        if traced:
            tensors, method = traced, f"traced on fake tensors: one step at micro-batch {micro}"
    if fsdp:
        tensors = tensors - probed.states + probed.states / world
        method += f", states sharded over {world} (FSDP)"
    return MemoryPlan(int(tensors), method)


def _fake_mode(model):
    """The FakeTensorMode a model built on fake tensors belongs to; None for a real one."""
    from torch._subclasses.fake_tensor import FakeTensor

    first = next(iter(model.parameters()), None)
    return first.fake_mode if isinstance(first, FakeTensor) else None


def _traced(model, loss, batch: dict, precision: str, say_failure) -> int | None:
    """Peak tensor bytes of one step traced on fake tensors (plan/traced.py); None where tracing fails (say,
    an op with no fake-tensor kernel), and the saved-activation estimate stands."""
    low = "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("16") else "fp32"
    device = next(model.parameters()).device.type
    try:
        return traced_run_memory(model, loss, batch, low, device, mode=_fake_mode(model))
    except Exception as e:  # noqa: BLE001 - a user's model: any failure falls back to the estimate
        if say_failure is not None:
            say_failure(f"gpuwise: tracing the step failed ({first_line(e)}); memory planned from saved activations")
        return None


def plan_step(cfg, flops_per_step: float, precision: str, accelerator: str, device_index: int, world: int,
              share: int, trainable: int, prepare: Callable[[], Any]) -> dict:  # fmt: skip
    """The one rule for a training step's time on a device here (`gpuwise train`, and `gpuwise launch` for CPU
    nodes): the counted FLOPs over the device's peak at the efficiency `gpuwise bench` calibrated (else the
    published one), plus the time to prepare a batch, timed here. Its figures: step_time_s, data_s,
    efficiency and their origins, the time method, the peak."""
    peak, peak_origin = measure.peak_flops(accelerator, precision, device_index)
    device_key = measure.device_key(accelerator, device_index)
    figures = measure.step_time_plan(device_key, cfg.workload, precision, flops_per_step, peak, world, share,
                                     trainable, prepare)  # fmt: skip
    return figures | {"peak": peak, "peak_origin": peak_origin, "device_key": device_key}


def plan_run(run: Run, micro: int | None, step: int, forward_backward: Callable[[int, int], float]) -> RunPlan:
    """The run's plan before its first step: its memory (`plan_memory`), the micro-batch fitted to memory unless
    it is given (`micro`: --micro-batch-size, or a resumed run's; on CUDA with a real probe step of
    `forward_backward(step, micro)`), and its step time (`plan_step`)."""
    lay, fabric, work, raw = run.layout, run.fabric, run.work, run.raw

    def batch(n: int) -> dict:
        made = fabric.to_device(work.make_batch(list(range(n)), 0))
        if lay.precision == "bf16-true":  # bf16 weights: the raw module skips the input conversion Fabric does
            made = fabric.strategy.precision.convert_input(made)
        return made

    probed = probe(raw, work.loss, batch, lay.share)
    if micro is None:
        budget = fit.available_bytes(lay.accelerator, fabric.local_rank if lay.accelerator == "cuda" else 0)
        micro = fit.largest_fitting(lay.share, probed.estimate, int(budget * 0.9) if budget else None)
        if lay.accelerator == "cuda":

            def trial(m: int) -> None:
                forward_backward(step, m)
                run.optimizer.zero_grad(set_to_none=True)

            micro = fit.probe(micro, trial)
    micro = min(micro, lay.share)
    memory = plan_memory(raw, work.loss, batch, probed, lay.cfg, micro, lay.precision, lay.world,
                         lay.strategy == "fsdp", work.model_spec, lambda line: say(fabric, line))  # fmt: skip
    flops_per_step = probed.flops_per_sample * lay.batch_size
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    prepare = lambda: work.make_batch(list(range(lay.share)), 0)  # noqa: E731
    figures: dict = {"peak_bytes": memory.peak_bytes}
    step_plan = plan_step(lay.cfg, flops_per_step, lay.precision, lay.accelerator, fabric.local_rank, lay.world,
                          lay.share, trainable, prepare)  # fmt: skip
    peak, peak_origin, device_key = step_plan.pop("peak"), step_plan.pop("peak_origin"), step_plan.pop("device_key")
    figures |= step_plan
    time_method = figures.pop("time_method")
    figures["method"] = f"memory: {memory.method}; time = {time_method}"
    return RunPlan(micro, figures, flops_per_step, peak, peak_origin, device_key)


def analytic_plan(spec, cfg, micro: int, precision: str, raw) -> int:
    """For transformer workloads: `gpuwise plan`'s analytic activations, with the states of the model as this
    run holds them. `gpuwise plan` counts mixed precision as Megatron keeps it (16-bit weights and gradients,
    fp32 master weights and moments: 16 bytes a parameter); Fabric's autocast keeps fp32 weights and
    gradients, the moments, and a 16-bit copy of each matrix a product reads, alive from forward to backward
    (18), which is what this counts."""
    task = {"full": "finetune"}.get(cfg.method, cfg.method)
    req = PlanRequest(
        task=task,
        batch=micro,
        seq=cfg.block_size,
        precision="fp32" if precision == "32-true" else "bf16",
        lora_rank=cfg.lora_rank if task != "finetune" else None,
        checkpointing="none",
    )
    mem = memory(spec, req, Layout())
    casts = 0
    if precision in ("bf16-mixed", "16-mixed"):
        matrices = {id(m.weight): m.weight for m in raw.modules() if isinstance(m, torch.nn.Linear)}
        # an NF4 weight (bitsandbytes', or one marked so on fake tensors) is dequantized, not cast
        cast = [w for w in matrices.values() if w.dtype == torch.float32 and not hasattr(w, "stored_bytes")]
        casts = 2 * sum(w.numel() for w in cast)
    # The step's peak falls in the loss's backward: the gradient of the logits (fp32, and 16-bit under
    # autocast) exists beside everything forward saved. In fp32 the formula's fp32 upcast of the logits is
    # no copy, and those 4 bytes stand for the gradient's (docs/benchmarks.md has the figures behind both).
    logit_grads = cfg.block_size * micro * spec.vocab * (6 if req.precision == "bf16" else 0)
    # Not every weight's gradient is alive at that peak: backward makes each layer's as it frees that layer's
    # activations, so as it starts only the output layer's exists. The end of backward (every gradient, no
    # activations) is the other candidate.
    states = measure.state_bytes(raw)
    grads = sum(p.numel() * p.element_size() for p in raw.parameters() if p.requires_grad)
    head = raw.get_output_embeddings() if hasattr(raw, "get_output_embeddings") else None
    head_grad = (
        head.weight.numel() * head.weight.element_size() if head is not None and head.weight.requires_grad else 0
    )
    return int(max(states - grads + head_grad + mem.activations + casts + logit_grads, states))
