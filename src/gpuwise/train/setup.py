"""A training run's set-up, everything before its first step (torchtune's recipes: set-up, train,
clean-up): the run directory claimed, the config resolved once into a frozen `Layout`, the model and
optimizer handed to Fabric, and the newest checkpoint restored. The plan the run is compared with is
`runplan.plan_run`; the loop (`loop.py`) starts from a `Run`."""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.plan.optim import adamw
from gpuwise.train import checkpoint
from gpuwise.train.config import TrainConfig
from gpuwise.train.records import Recorder, RunClaim
from gpuwise.train.rng import set_rng_state
from gpuwise.workloads import build as build_workload
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


@dataclass(frozen=True)
class Layout:
    """A run's config resolved once, before its first step: the flags with the workload's defaults filled in
    (what config.yaml holds), where it runs, and the run's length. Nothing changes it afterwards."""

    cfg: TrainConfig
    accelerator: str
    precision: str
    strategy: str
    world: int  # processes
    share: int  # samples of each step on this process
    steps_per_epoch: int
    total: int  # steps
    ckpt_every: int
    weight_decay: float

    @property
    def batch_size(self) -> int:
        assert self.cfg.batch_size is not None  # `schedule` refuses a config without one
        return self.cfg.batch_size

    @property
    def lr(self) -> float:
        assert self.cfg.lr is not None  # `schedule` refuses a config without one
        return self.cfg.lr


def schedule(cfg: TrainConfig, train_size: int, steps: int | None, world: int) -> tuple[int, int, int]:
    """(samples a process takes each step, steps an epoch, steps in all) of a config whose defaults are filled
    in; `steps`: a workload's fixed length (`Training.steps`), else --max-steps or --epochs decide. `gpuwise
    launch` plans a job with the same rule."""
    if cfg.batch_size is None or cfg.lr is None:
        raise GpuwiseError(f"workload {cfg.workload} gives no default --batch-size or --lr: pass both")
    if cfg.batch_size % world:
        raise GpuwiseError(
            f"the global batch {cfg.batch_size} must be divisible by the {world} processes (--batch-size)"
        )
    per_epoch = train_size // cfg.batch_size
    if per_epoch == 0:
        raise GpuwiseError(f"--batch-size {cfg.batch_size} is larger than the {train_size} training samples")
    if steps is None:
        steps = cfg.max_steps or math.ceil((cfg.epochs or 1) * per_epoch)
    return cfg.batch_size // world, per_epoch, steps


def lay_out(cfg: TrainConfig, work: Training, world: int, accelerator: str, precision: str, strategy: str) -> Layout:
    """The last steps of the one resolution of a run's config (after `TrainConfig.resolved` and the build): the
    workload's defaults filled in, then the layout over `world` processes. `gpuwise train` and `gpuwise launch`
    both lay a run out here."""
    cfg = cfg.filled(work.defaults)
    share, per_epoch, total = schedule(cfg, work.train_size, work.steps, world)
    return Layout(
        cfg,
        accelerator,
        precision,
        strategy,
        world,
        share,
        per_epoch,
        total,
        ckpt_every=cfg.checkpoint_every or max(1, total // 10),
        weight_decay=work.defaults.get("weight_decay", 0.01),
    )


@dataclass
class Progress:
    """What moves as the run goes: the step, the micro-batch (halved on an out-of-memory error), the OOM
    history, and the training seconds of the run before this process resumed it. A checkpoint holds it."""

    step: int = 0
    micro: int | None = None  # None until the plan fits one
    oom_events: list = field(default_factory=list)
    elapsed_before: float = 0.0


@dataclass
class Run:
    """What the loop needs, built before its first step."""

    layout: Layout
    fabric: Any
    rec: Recorder
    work: Training
    model: Any  # as Fabric wrapped it
    twin: Any  # FSDP: rank 0's unsharded copy the gathered weights are loaded into at the end
    optimizer: Any
    scheduler: Any

    @property
    def cfg(self) -> TrainConfig:
        return self.layout.cfg

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
    """The workload built, its defaults filled into the config (saved as config.yaml), the run's layout, and
    the model, optimizer and schedule set up by Fabric."""
    fabric.seed_everything(cfg.seed, verbose=False)

    work = build_workload(cfg, rec.run_dir)
    layout = lay_out(cfg, work, fabric.world_size, accelerator, precision, strategy)
    rec.save_config(layout.cfg)
    rec.watch(accelerator)
    model = work.model
    # FSDP shards the model in place, yet the saved model must be whole: rank 0 keeps an unsharded
    # twin (one more copy in host memory) to load the gathered weights into at the end.
    twin = copy.deepcopy(model) if strategy == "fsdp" and fabric.is_global_zero else None
    # The optimizer is made after setup, because FSDP replaces the parameters by their shards.
    model = fabric.setup_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, layout.lr, accelerator, layout.weight_decay, sharded=strategy == "fsdp")
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(layout.total))
    return Run(layout, fabric, rec, work, model, twin, optimizer, scheduler)


def restore(run: Run) -> Progress:
    """Resume: the progress (step, micro-batch, OOM history, elapsed time) of the newest checkpoint that is
    whole and loads; the metrics logged after it are dropped. Each one skipped gets one line: a corrupt
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
                run.rec.rewind(restored[0])
                return Progress(*restored)
        say(fabric, f"gpuwise: checkpoint {path.name} is corrupt ({why}); using the one before it")
    if found:
        raise GpuwiseError(f"{run_dir}: no usable checkpoint to resume from (each one above is corrupt)")
    say(fabric, f"gpuwise: {run_dir} has no checkpoint yet: starting it from step 0")
    run.rec.rewind(0)
    return Progress()
