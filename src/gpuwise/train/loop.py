"""The training loop: data -> forward -> loss -> backward -> update, repeated; evaluation; checkpoints.

One file, read top to bottom (nanoGPT): set-up (`setup.py`) and the plan (`runplan.py`), then the loop
(`_train`: step, log, evaluate, checkpoint), then evaluation, the saved model and the summary
(`summary.py`). Fabric owns device, precision and strategy; the workload owns data, model, loss and
metrics. The math of a step is fixed by the global batch alone: each step takes the next ``batch_size``
samples of a seeded permutation, each process its slice, each slice cut into micro-batches whose losses
are weighted by their share. Resume, a different micro-batch, or more processes therefore give the same
weights (for models whose forward draws no random numbers: dropout masks would differ between 1 and N
processes; resume restores the RNG, so it stays exact).
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import time
from dataclasses import replace
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.train import checkpoint, fit, measure, setup
from gpuwise.train.config import TrainConfig
from gpuwise.train.engine import make_fabric
from gpuwise.train.records import is_finished, load_config
from gpuwise.train.rng import forward_rng, rng_state, set_forward_rng
from gpuwise.train.runplan import RunPlan, plan_run
from gpuwise.train.setup import Run, say
from gpuwise.train.summary import summarize


@functools.lru_cache(maxsize=1)  # every step of an epoch slices one order; no step needs an older one
def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_samples(step: int, batch: int, n: int, seed: int) -> tuple[list[int], int]:
    """The global batch of a step: a slice of the epoch's seeded permutation (drop-last). The slice is a
    copy, so no caller can change the cached order."""
    epoch, k = divmod(step, n // batch)
    return _epoch_order(seed, epoch, n)[k * batch : (k + 1) * batch], epoch


class StopFlag:
    """SIGTERM/SIGINT end the current step, write a checkpoint and stop."""

    def __init__(self):
        self.signal = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame):
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _scalars(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _progress(console, total: int, start: int):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    # One bar for the whole run: it names the phase (an evaluation on held-out data can take minutes) and its
    # clock keeps running through it.
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[sps]:,.0f} samples/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    bar.start()
    return bar, bar.add_task("train", total=total, completed=start, loss=float("nan"), sps=0.0)


@contextlib.contextmanager
def _phase(bar, what: str):
    """The bar names `what` while it runs, then `train` again."""
    if bar:
        bar[0].update(bar[1], description=what)
    try:
        yield
    finally:
        if bar:
            bar[0].update(bar[1], description="train")


def train(cfg: TrainConfig, resume_dir: Path | None = None, console=None) -> dict | None:
    """Train the workload `cfg` names (or resume the run in `resume_dir`); the summary on rank 0."""
    cfg.validate()
    cfg = cfg.resolved()  # options that follow from others, set before the build
    fabric, accelerator, precision, strategy = make_fabric(cfg)
    rec, claim = setup.claim(cfg, fabric, resume_dir)
    try:
        # --- set-up ---------------------------------------------------------------------------
        train_parts(cfg, fabric, rec, console)
        run = setup.build(cfg, fabric, accelerator, precision, strategy, rec)
        progress = setup.restore(run) if resume_dir is not None else setup.Progress()
        micro = progress.micro or cfg.micro_batch_size  # a resumed run keeps the micro-batch it had come down to
        plan = plan_run(run, micro, progress.step, lambda step, m: forward_backward(run, step, m))
        progress.micro = plan.micro
        return _train(run, plan, progress, console)
    except BaseException:
        rec.close()
        if claim is not None:
            claim.discard_if_unused()  # silently: the error says what went wrong, and nothing was lost
        raise
    finally:
        if claim is not None:
            claim.release()


def train_parts(cfg: TrainConfig, fabric, rec, console) -> None:
    """The runs this one is assembled from (`Workload.parts`), each trained to its end in RUN/parts/NAME
    before this run builds: one finished before is kept, one interrupted is resumed from its checkpoint.
    This run's config is saved first, so that `--resume RUN` finds it if a part is interrupted."""
    parts = cfg.workload_def().parts(cfg)
    if not parts:
        return
    rec.save_config(cfg)
    for n, (name, part) in enumerate(parts, 1):
        where = rec.run_dir / "parts" / name
        if is_finished(where):
            say(fabric, f"gpuwise: part {n} of {len(parts)} ({name}) has finished: {where}")
            continue
        say(fabric, f"gpuwise: part {n} of {len(parts)} ({name}), trained in {where}")
        if (where / "config.yaml").is_file():
            resume(where, console=console)
        else:
            train(replace(part, run_dir=str(where)), console=console)
        fabric.barrier()  # the first process writes the part's summary.json last; the others read it next


def resume(run_dir: Path, console=None) -> dict | None:
    if not run_dir.is_dir():  # before load_config, so that the message names the flag
        raise GpuwiseError(f"--resume {run_dir}: no such run directory")
    return train(load_config(run_dir), resume_dir=run_dir, console=console)


def forward_backward(run: Run, step: int, micro: int) -> float:
    """Forward and backward of this process's slice of the step, micro-batch by micro-batch; the mean loss."""
    lay, fabric, work = run.layout, run.fabric, run.work
    samples, epoch = step_samples(step, lay.batch_size, work.train_size, lay.cfg.seed)
    mine = samples[fabric.global_rank * lay.share : (fabric.global_rank + 1) * lay.share]
    chunks = [mine[i : i + micro] for i in range(0, len(mine), micro)]
    total_loss = 0.0
    for i, chunk in enumerate(chunks):
        batch = fabric.to_device(work.make_batch(chunk, epoch))
        with fabric.no_backward_sync(run.model, enabled=i < len(chunks) - 1):
            loss = work.loss(run.model, batch) * (len(chunk) / len(mine))
            fabric.backward(loss)
        total_loss += loss.item()
    return total_loss


class Meters:
    """What the loop measures besides the loss: the peak memory the way the plan counts it (tensors only,
    over the last step: after the first the optimizer states exist, and a profiled step slows the few after
    it), the process's peak, and each step's time."""

    def __init__(self, run: Run):
        raw, accelerator = run.raw, run.layout.accelerator
        self.memory = measure.PeakMemory(accelerator, sum(p.numel() * p.element_size() for p in raw.parameters()))
        self.step_peak = measure.StepPeak(accelerator, lambda: measure.held_bytes(raw, run.optimizer))
        self.profiled_step = run.layout.total - 1
        self.times: list[float] = []
        self.started = time.perf_counter()

    def around(self, step: int):
        return self.step_peak if step == self.profiled_step else contextlib.nullcontext()

    def took(self, step: int, seconds: float, accelerator: str) -> None:
        if step != self.profiled_step or accelerator != "cpu":  # a profiled step is slower: not timed
            self.times.append(seconds)


def _train(run: Run, plan: RunPlan, progress: setup.Progress, console) -> dict | None:
    """The loop: step, log, evaluate now and then, checkpoint; then evaluate, save and summarize."""
    lay, fabric = run.layout, run.fabric
    meters = Meters(run)
    bar = _progress(console, lay.total, progress.step) if fabric.is_global_zero and console and lay.total else None
    before = None
    if run.work.eval_before and progress.step == 0:
        with _phase(bar, "evaluating before training (held out)"):
            before = _evaluate(run, meters, 0)
    stop, inject, loss = StopFlag(), fit.OOMInjector(), float("nan")
    try:
        while progress.step < lay.total:
            t0 = time.perf_counter()
            with meters.around(progress.step):
                loss = _step(run, progress, inject)
            if lay.accelerator == "cuda":
                torch.cuda.synchronize()
            progress.step += 1
            if lay.world > 1:
                loss = fabric.all_reduce(torch.tensor(loss, device=fabric.device), reduce_op="mean").item()
            took = time.perf_counter() - t0
            meters.took(progress.step - 1, took, lay.accelerator)
            _log(run, progress, loss, took, bar)
            if lay.cfg.eval_every and progress.step % lay.cfg.eval_every == 0 and progress.step < lay.total:
                with _phase(bar, "evaluating (held out)"):
                    _evaluate(run, meters, progress.step)
            stopping = _stopping(run, stop)
            if progress.step % lay.ckpt_every == 0 or progress.step == lay.total or stopping:
                _checkpoint(run, progress, meters.started)
            if stopping:
                if bar:
                    bar[0].stop()
                run.rec.close()
                raise _stopped(stop, progress.step, run.run_dir)
    finally:
        stop.restore()
    try:
        with _phase(bar, "final evaluation (held out)"):
            return _finish(run, plan, progress, meters, loss, before)
    finally:
        if bar:
            bar[0].stop()


def _step(run: Run, progress: setup.Progress, inject: fit.OOMInjector) -> float:
    """One optimizer step at the current micro-batch; on an out-of-memory error the micro-batch is halved and
    the step retried with the same dropout masks (the global batch, and so the math, is kept)."""
    fabric, optimizer, lay = run.fabric, run.optimizer, run.layout
    assert progress.micro is not None  # plan_run fitted it
    rng = forward_rng()  # torch's generators only: the forward's dropout is all that draws from them
    while True:
        try:
            inject.check(progress.step, progress.micro)
            loss = forward_backward(run, progress.step, progress.micro)
            break
        except Exception as e:  # noqa: BLE001 - only an OOM is handled; everything else propagates
            if not fit.is_oom(e) or progress.micro == 1:
                raise
            optimizer.zero_grad(set_to_none=True)
            if lay.accelerator == "cuda":
                torch.cuda.empty_cache()
            set_forward_rng(rng)
            smaller = max(1, progress.micro // 2)
            progress.oom_events.append({"step": progress.step, "from": progress.micro, "to": smaller})
            progress.micro = smaller
            say(
                fabric,
                f"gpuwise: out of memory at step {progress.step}: micro-batch now {smaller}, "
                f"accumulation {math.ceil(lay.share / smaller)} (global batch {lay.batch_size} kept)",
            )
    fabric.clip_gradients(run.model, optimizer, max_norm=1.0)
    optimizer.step()
    run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _log(run: Run, progress: setup.Progress, loss: float, took: float, bar) -> None:
    batch = run.layout.batch_size
    run.rec.log(
        progress.step,
        loss=loss,
        lr=run.scheduler.get_last_lr()[0],
        step_time_s=took,
        samples_per_s=batch / took,
        micro_batch=progress.micro,
    )
    if bar:
        bar[0].update(bar[1], completed=progress.step, loss=loss, sps=batch / took)


def _evaluate(run: Run, meters: Meters, step: int) -> dict:
    """The held-out metrics now, logged at `step`; not counted in the training step's peak memory."""
    with meters.memory.paused():
        metrics = run.work.evaluate(run.model, run.fabric.device)
    run.rec.log(step, **{f"eval/{k}": v for k, v in _scalars(metrics).items()})
    return metrics


def _stopping(run: Run, stop: StopFlag) -> bool:
    """Whether a signal asked to stop; one process's signal stops them all, at the same step."""
    stopping = stop.signal is not None
    if run.layout.world > 1:
        flag = torch.tensor(float(stopping), device=run.fabric.device)
        stopping = bool(run.fabric.all_reduce(flag, reduce_op="sum").item())
    return stopping


def _stopped(stop: StopFlag, step: int, run_dir: Path) -> GpuwiseError:
    name = signal.Signals(stop.signal).name if stop.signal else "a signal"
    return GpuwiseError(
        f"stopped by {name} at step {step}; checkpoint written. Continue with `gpuwise train --resume {run_dir}`",
        exit_code=128 + (stop.signal or 15),
    )


def _checkpoint(run: Run, progress: setup.Progress, started: float) -> None:
    lay, fabric = run.layout, run.fabric
    state = {
        "model": run.model,
        "optimizer": run.optimizer,
        "scheduler": run.scheduler.state_dict(),
        "step": progress.step,
        "micro_batch": progress.micro,
        "rng": rng_state(),
        "oom_events": progress.oom_events,
        "precision": fabric.strategy.precision.state_dict(),
        "data": {
            "epoch": progress.step // lay.steps_per_epoch,
            "offset": (progress.step % lay.steps_per_epoch) * lay.batch_size,
        },
        "elapsed": progress.elapsed_before + time.perf_counter() - started,
    }
    checkpoint.save(fabric, run.run_dir / "checkpoints", progress.step, state, lay.cfg.keep_checkpoints)


def _finish(run: Run, plan: RunPlan, progress: setup.Progress, meters: Meters, loss: float, before) -> dict | None:
    """Evaluate, save the whole model (gathered from FSDP's shards) and summarize the run."""
    lay, fabric, raw = run.layout, run.fabric, run.raw
    # before evaluation, whose batches are not the training step's; none for a run of no steps (Training.steps)
    process_peak = meters.memory.read() if lay.total else None
    evaluation = run.work.evaluate(run.model, fabric.device)
    if lay.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if run.twin is not None:
            run.twin.load_state_dict(whole)
            raw = run.twin
    files = run.work.save(raw, run.run_dir) if fabric.is_global_zero else []
    fabric.barrier()

    step_peak = meters.step_peak
    return summarize(
        run,
        plan,
        progress,
        times=meters.times,
        final_loss=loss,
        evaluation=evaluation,
        before=before,
        peak_bytes=step_peak.bytes if step_peak.bytes else process_peak,
        memory_method=step_peak.method if step_peak.bytes else meters.memory.method,
        process_peak_bytes=process_peak if lay.accelerator == "cpu" else None,
        files=files,
        started=meters.started,
    )
