"""A training run's set-up, everything before its first step (torchtune's recipes: set-up, train,
clean-up): the run directory claimed, the workload built, the model and optimizer handed to Fabric,
the newest checkpoint restored, the micro-batch fitted to memory, and the plan the run is then
measured against. The loop itself (`loop.py`) starts from a `Run`."""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.plan.optim import adamw
from gpuwise.train import checkpoint, fit, measure
from gpuwise.train.config import TrainConfig
from gpuwise.train.records import Recorder, RunClaim
from gpuwise.train.rng import rng_state, set_rng_state
from gpuwise.workloads.base import Training


def say(fabric, message: str) -> None:
    """One line on stderr from the first process: stdout stays clean for --json."""
    if fabric.is_global_zero:
        print(message, file=sys.stderr, flush=True)


def lr_lambda(total: int):
    warmup = max(1, min(100, total // 20))

    def f(step: int) -> float:  # linear warm-up, then cosine down to 10 %
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return f


@dataclass
class Run:
    """What the loop needs, built before its first step; `step`, `micro` and `oom_events` move as it runs."""

    cfg: TrainConfig
    fabric: Any
    accelerator: str
    precision: str
    strategy: str
    rec: Recorder
    work: Training
    model: Any  # as Fabric wrapped it
    twin: Any  # FSDP: rank 0's unsharded copy the gathered weights are loaded into at the end
    optimizer: Any
    scheduler: Any
    world: int
    share: int  # samples of each step on this process
    steps_per_epoch: int
    total: int  # steps
    ckpt_every: int
    step: int = 0
    micro: int | None = None
    oom_events: list = field(default_factory=list)
    elapsed_before: float = 0.0  # training seconds of the run before this process resumed it
    plan: dict = field(default_factory=dict)
    flops_per_step: float = 0.0
    peak: float | None = None
    peak_origin: str = ""
    device_key: str = ""

    @property
    def run_dir(self) -> Path:
        return self.rec.run_dir

    @property
    def raw(self):
        """The model without Fabric's wrapper."""
        return self.model.module if hasattr(self.model, "module") else self.model


def claim(cfg: TrainConfig, fabric, resume_dir: Path | None) -> tuple[Recorder, RunClaim | None]:
    """Rank 0 claims the run directory (a default name comes from the clock) and checks it; all ranks
    learn the answer, so a refusal stops every process instead of leaving the others waiting."""
    choice: str | GpuwiseError | None = None
    held: RunClaim | None = None
    if fabric.is_global_zero:
        try:
            held = RunClaim.resume(resume_dir) if resume_dir else RunClaim.new(cfg)
            choice = str(held.path)
        except GpuwiseError as e:
            choice = GpuwiseError(str(e))
    choice = fabric.broadcast(choice, src=0)
    if isinstance(choice, GpuwiseError):
        raise choice
    return Recorder(Path(choice), fabric.is_global_zero), held


def build(cfg: TrainConfig, fabric, accelerator: str, precision: str, strategy: str, rec: Recorder) -> Run:
    """The workload, its defaults filled into the config (saved as config.yaml), the run's length, and
    the model, optimizer and schedule set up by Fabric."""
    fabric.seed_everything(cfg.seed, verbose=False)
    from gpuwise.workloads import build as build_workload

    work = build_workload(cfg, rec.run_dir)
    for key, value in work.defaults.items():
        if getattr(cfg, key, None) is None:
            setattr(cfg, key, value)
    rec.save_config(cfg)
    assert cfg.batch_size is not None and cfg.lr is not None  # the workload's defaults give both
    world = fabric.world_size
    if cfg.batch_size % world:
        raise GpuwiseError(f"--batch-size {cfg.batch_size} must be divisible by the {world} processes")
    steps_per_epoch = work.train_size // cfg.batch_size
    if steps_per_epoch == 0:
        raise GpuwiseError(f"--batch-size {cfg.batch_size} is larger than the {work.train_size} training samples")
    if work.steps is not None:
        total = work.steps
    elif cfg.max_steps:
        total = cfg.max_steps
    else:
        assert cfg.epochs is not None  # the workload's defaults give it
        total = math.ceil(cfg.epochs * steps_per_epoch)

    model = work.model
    # FSDP shards the model in place, yet the saved model must be whole: rank 0 keeps an unsharded
    # twin (one more copy in host memory) to load the gathered weights into at the end.
    twin = copy.deepcopy(model) if strategy == "fsdp" and fabric.is_global_zero else None
    # The optimizer is made after setup, because FSDP replaces the parameters by their shards.
    model = fabric.setup_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = work.defaults.get("weight_decay", 0.01)
    optimizer = adamw(params, cfg.lr, accelerator, decay, sharded=strategy == "fsdp")
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total))
    return Run(
        cfg,
        fabric,
        accelerator,
        precision,
        strategy,
        rec,
        work,
        model,
        twin,
        optimizer,
        scheduler,
        world=world,
        share=cfg.batch_size // world,
        steps_per_epoch=steps_per_epoch,
        total=total,
        ckpt_every=cfg.checkpoint_every or max(1, total // 10),
        micro=cfg.micro_batch_size,
    )


def restore(run: Run) -> None:
    """Resume: the newest checkpoint that is whole and loads sets the step, micro-batch, OOM history and
    elapsed time; the metrics logged after it are dropped. Each one skipped gets one line: a corrupt
    file, or one that passes its checksum yet does not load (a planted pickle, a state of another shape)."""
    fabric, run_dir = run.fabric, run.run_dir
    found = False
    for path, why in checkpoint.candidates(run_dir / "checkpoints"):
        found = True
        if why is None:
            try:
                rest = checkpoint.load(fabric, path, {"model": run.model, "optimizer": run.optimizer})
                run.scheduler.load_state_dict(rest["scheduler"])
                fabric.strategy.precision.load_state_dict(rest["precision"])
                set_rng_state(rest["rng"])  # rank 0's: exact for one process, fresh-but-valid draws for the others
                restored = int(rest["step"]), int(rest["micro_batch"]), list(rest["oom_events"]), float(rest["elapsed"])
            except (KeyboardInterrupt, SystemExit):
                raise
            # An untrusted file fails in any of torch's, pickle's or our types, and torch.distributed.checkpoint's
            # CheckpointException is a BaseException.
            except BaseException as e:  # noqa: BLE001
                why = f"does not load: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
            else:
                say(fabric, f"gpuwise: resuming {run_dir} at step {restored[0]} from {path.name}")
                run.step, run.micro, run.oom_events, run.elapsed_before = restored
                run.rec.rewind(run.step)
                return
        say(fabric, f"gpuwise: checkpoint {path.name} is corrupt ({why}); using the one before it")
    if found:
        raise GpuwiseError(f"{run_dir}: no usable checkpoint to resume from (each one above is corrupt)")
    say(fabric, f"gpuwise: {run_dir} has no checkpoint yet: starting it from step 0")
    run.rec.rewind(0)


def fit_and_plan(run: Run, forward_backward: Callable[[int, int], float]) -> None:
    """Measure one step (FLOPs, activations saved for backward), fit the micro-batch to memory (on CUDA
    with a real probe step of `forward_backward(step, micro)`), and plan the run's memory and step time."""
    cfg, fabric, work, raw = run.cfg, run.fabric, run.work, run.raw
    rng = rng_state()
    probe_n = min(run.share, 4)
    probe_batch = fabric.to_device(work.make_batch(list(range(probe_n)), 0))
    if run.precision == "bf16-true":
        # bf16 weights: the raw module skips the input conversion Fabric's wrapper does
        probe_batch = fabric.strategy.precision.convert_input(probe_batch)
    flops, saved = measure.probe_step(raw, work.loss, probe_batch)
    flops_per_sample, saved_per_sample = flops / probe_n, saved / probe_n
    states = measure.state_bytes(raw)

    def estimate(m: int) -> float:
        return states + saved_per_sample * m

    if run.micro is None:
        budget = fit.available_bytes(run.accelerator, fabric.local_rank if run.accelerator == "cuda" else 0)
        run.micro = fit.largest_fitting(run.share, estimate, int(budget * 0.9) if budget else None)
        if run.accelerator == "cuda":

            def probe(m: int) -> None:
                forward_backward(run.step, m)
                run.optimizer.zero_grad(set_to_none=True)

            run.micro = fit.probe(run.micro, probe)
    run.micro = min(run.micro, run.share)
    set_rng_state(rng)
    run.peak, run.peak_origin = measure.peak_flops(run.accelerator, run.precision, fabric.local_rank)
    assert cfg.batch_size is not None  # build() filled it from the workload's defaults
    run.flops_per_step = flops_per_sample * cfg.batch_size
    run.device_key = measure.device_key(run.accelerator, fabric.local_rank)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    plan: dict = {"peak_bytes": int(estimate(run.micro))}
    plan |= measure.step_time_plan(
        run.device_key,
        cfg.workload,
        run.precision,
        run.flops_per_step,
        run.peak,
        run.world,
        run.share,
        trainable,
        lambda: work.make_batch(list(range(run.share)), 0),
    )
    time_method = plan.pop("time_method")
    memory_method = "model states + activations saved for backward, counted on one micro-batch"
    if work.model_spec is not None:
        analytic = analytic_plan(work, cfg, run.micro, run.precision, raw)
        plan["peak_bytes"], memory_method = analytic["peak_bytes"], analytic["method"]
    elif run.strategy != "fsdp":  # FSDP's shards are traced by `gpuwise plan --traced --gpus N`, not here
        traced = traced_plan_bytes(raw, work, fabric, run.micro, run.precision)
        if traced:
            plan["peak_bytes"], memory_method = traced, f"traced on fake tensors: one step at micro-batch {run.micro}"
    plan["method"] = f"memory: {memory_method}; time = {time_method}"
    run.plan = plan


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
