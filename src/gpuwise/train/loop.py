"""The training loop: data -> forward -> loss -> backward -> update, repeated; evaluation; checkpoints.

One file, read top to bottom (nanoGPT): set-up (`setup.py`), the steps, then evaluation, the saved
model and the summary (`summary.py`). Fabric owns device, precision and strategy; the workload owns
data, model, loss and metrics. The math of a step is fixed by the global batch alone: each step takes
the next ``batch_size`` samples of a seeded permutation, each process its slice, each slice cut into
micro-batches whose losses are weighted by their share. Resume, a different micro-batch, or more
processes therefore give the same weights (for models whose forward draws no random numbers: dropout
masks would differ between 1 and N processes; resume restores the RNG, so it stays exact).
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import time
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.train import checkpoint, fit, measure, setup
from gpuwise.train.config import TrainConfig
from gpuwise.train.engine import make_fabric
from gpuwise.train.records import is_finished, load_config
from gpuwise.train.rng import forward_rng, rng_state, set_forward_rng
from gpuwise.train.setup import Run, say


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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[sps]:,.0f} samples/s"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    bar.start()
    return bar, bar.add_task("train", total=total, completed=start, loss=float("nan"), sps=0.0)


def train(cfg: TrainConfig, resume_dir: Path | None = None, console=None) -> dict | None:
    """Train the workload `cfg` names (or resume the run in `resume_dir`); the summary on rank 0."""
    cfg.validate()
    fabric, accelerator, precision, strategy = make_fabric(cfg)
    rec, claim = setup.claim(cfg, fabric, resume_dir)
    try:
        # --- set-up ---------------------------------------------------------------------------
        train_parts(cfg, fabric, rec, console)
        run = setup.build(cfg, fabric, accelerator, precision, strategy, rec)
        if resume_dir is not None:
            setup.restore(run)
        setup.fit_and_plan(run, lambda step, micro: forward_backward(run, step, micro))
        return _train(run, console)
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
            part.run_dir = str(where)
            train(part, console=console)
        fabric.barrier()  # the first process writes the part's summary.json last; the others read it next


def resume(run_dir: Path, console=None) -> dict | None:
    if not run_dir.is_dir():  # before load_config, so that the message names the flag
        raise GpuwiseError(f"--resume {run_dir}: no such run directory")
    return train(load_config(run_dir), resume_dir=run_dir, console=console)


def forward_backward(run: Run, step: int, micro: int) -> float:
    """Forward and backward of this process's slice of the step, micro-batch by micro-batch; the mean loss."""
    cfg, fabric, work = run.cfg, run.fabric, run.work
    assert cfg.batch_size is not None  # the workload's default filled it in set-up
    samples, epoch = step_samples(step, cfg.batch_size, work.train_size, cfg.seed)
    mine = samples[fabric.global_rank * run.share : (fabric.global_rank + 1) * run.share]
    chunks = [mine[i : i + micro] for i in range(0, len(mine), micro)]
    total_loss = 0.0
    for i, chunk in enumerate(chunks):
        batch = fabric.to_device(work.make_batch(chunk, epoch))
        with fabric.no_backward_sync(run.model, enabled=i < len(chunks) - 1):
            loss = work.loss(run.model, batch) * (len(chunk) / len(mine))
            fabric.backward(loss)
        total_loss += loss.item()
    return total_loss


def _train(run: Run, console) -> dict | None:
    cfg, fabric, work, rec, model, optimizer, scheduler = (
        run.cfg,
        run.fabric,
        run.work,
        run.rec,
        run.model,
        run.optimizer,
        run.scheduler,
    )
    accelerator, world, share, total, run_dir = run.accelerator, run.world, run.share, run.total, run.run_dir
    step, micro, oom_events, raw = run.step, run.micro, run.oom_events, run.raw
    assert micro is not None and cfg.batch_size is not None  # fit_and_plan and the workload's defaults set them

    # --- train ----------------------------------------------------------------------------
    inject, stop = fit.OOMInjector(), StopFlag()
    mem = measure.PeakMemory(accelerator, sum(p.numel() * p.element_size() for p in raw.parameters()))
    step_peak = measure.StepPeak(accelerator, lambda: measure.held_bytes(raw, optimizer))
    # The last step is the one measured: after the first the optimizer states exist, and a profiled step
    # slows the few after it (the scratch Llama's steps ran 164-193 ms after one, 118 before)
    measured_step = total - 1
    progress = _progress(console, total, step) if fabric.is_global_zero and console and total else None
    times, loss_value, t_run = [], float("nan"), time.perf_counter()
    before = None
    if work.eval_before and step == 0:
        with mem.paused():
            before = work.evaluate(model, fabric.device)
        rec.log(0, **{f"eval/{k}": v for k, v in _scalars(before).items()})
    try:
        while step < total:
            t0 = time.perf_counter()
            # measured the way the plan counts memory: tensors only (measure.StepPeak)
            with step_peak if step == measured_step else contextlib.nullcontext():
                rng = forward_rng()  # torch's generators only: the forward's dropout is all that draws from them
                while True:
                    try:
                        inject.check(step, micro)
                        loss_value = forward_backward(run, step, micro)
                        break
                    except Exception as e:  # noqa: BLE001 - only an OOM is handled; everything else propagates
                        if not fit.is_oom(e) or micro == 1:
                            raise
                        optimizer.zero_grad(set_to_none=True)
                        if accelerator == "cuda":
                            torch.cuda.empty_cache()
                        set_forward_rng(rng)  # the retried step draws the same dropout masks
                        oom_events.append({"step": step, "from": micro, "to": max(1, micro // 2)})
                        micro = max(1, micro // 2)
                        say(
                            fabric,
                            f"gpuwise: out of memory at step {step}: micro-batch now {micro}, "
                            f"accumulation {math.ceil(share / micro)} (global batch {cfg.batch_size} kept)",
                        )
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if accelerator == "cuda":
                torch.cuda.synchronize()
            step += 1
            if world > 1:
                loss_value = fabric.all_reduce(torch.tensor(loss_value, device=fabric.device), reduce_op="mean").item()
            took = time.perf_counter() - t0
            if step - 1 != measured_step or accelerator != "cpu":  # a profiled step is slower: not timed
                times.append(took)
            rec.log(
                step,
                loss=loss_value,
                lr=scheduler.get_last_lr()[0],
                step_time_s=took,
                samples_per_s=cfg.batch_size / took,
                micro_batch=micro,
            )
            if progress:
                progress[0].update(progress[1], completed=step, loss=loss_value, sps=cfg.batch_size / took)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                with mem.paused():
                    evaluation = work.evaluate(model, fabric.device)
                rec.log(step, **{f"eval/{k}": v for k, v in _scalars(evaluation).items()})
            stopping = stop.signal is not None
            if world > 1:  # one process's signal stops them all, at the same step
                flag = torch.tensor(float(stopping), device=fabric.device)
                stopping = bool(fabric.all_reduce(flag, reduce_op="sum").item())
            if step % run.ckpt_every == 0 or step == total or stopping:
                state = {
                    "model": model,
                    "optimizer": optimizer,
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "micro_batch": micro,
                    "rng": rng_state(),
                    "oom_events": oom_events,
                    "precision": fabric.strategy.precision.state_dict(),
                    "data": {
                        "epoch": step // run.steps_per_epoch,
                        "offset": (step % run.steps_per_epoch) * cfg.batch_size,
                    },
                    "elapsed": run.elapsed_before + time.perf_counter() - t_run,
                }
                checkpoint.save(fabric, run_dir / "checkpoints", step, state, cfg.keep_checkpoints)
            if stopping:
                if progress:
                    progress[0].stop()
                rec.close()
                name = signal.Signals(stop.signal).name if stop.signal else "a signal"
                raise GpuwiseError(
                    f"stopped by {name} at step {step}; checkpoint written. Continue with "
                    f"`gpuwise train --resume {run_dir}`",
                    exit_code=128 + (stop.signal or 15),
                )
    finally:
        stop.restore()
    if progress:
        progress[0].stop()
    # before evaluation, whose batches are not the training step's; none for a run of no steps (Training.steps)
    peak_bytes = mem.read() if total else None

    # --- evaluate, save, summarize -------------------------------------------------------------
    evaluation = work.evaluate(model, fabric.device)
    if run.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if run.twin is not None:
            run.twin.load_state_dict(whole)
            raw = run.twin
    files = work.save(raw, run_dir) if fabric.is_global_zero else []
    fabric.barrier()
    from gpuwise.train.summary import summarize

    run.step, run.micro, run.oom_events = step, micro, oom_events
    return summarize(
        run,
        times=times,
        final_loss=loss_value,
        evaluation=evaluation,
        before=before,
        peak_bytes=step_peak.bytes if step_peak.bytes else peak_bytes,
        memory_method=step_peak.method if step_peak.bytes else mem.method,
        process_peak_bytes=peak_bytes if accelerator == "cpu" else None,
        files=files,
        started=t_run,
    )
