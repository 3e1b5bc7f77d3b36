"""The training loop: data -> forward -> loss -> backward -> update, repeated; evaluation; checkpoints.

One file, read top to bottom (nanoGPT). Fabric owns device, precision and strategy; the workload owns
data, model, loss and metrics. The math of a step is fixed by the global batch alone: each step takes
the next ``batch_size`` samples of a seeded permutation, each process its slice, each slice cut into
micro-batches whose losses are weighted by their share. Resume, a different micro-batch, or more
processes therefore give the same weights (for models whose forward draws no random numbers: dropout
masks would differ between 1 and N processes; resume restores the RNG, so it stays exact).
"""

from __future__ import annotations

import copy
import functools
import math
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.train import checkpoint, fit, measure
from gpuwise.train.config import TrainConfig
from gpuwise.train.engine import make_fabric
from gpuwise.train.records import Recorder, RunClaim, load_config


def forward_rng():
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def set_forward_rng(state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def say(fabric, message: str) -> None:
    """One line on stderr from the first process: stdout stays clean for --json."""
    if fabric.is_global_zero:
        print(message, file=sys.stderr, flush=True)


def rng_state() -> dict:
    """Every generator's state as tensors and plain values, so that a checkpoint loads with
    `weights_only=True` (numpy's own state holds an ndarray, which that loader refuses)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@functools.lru_cache(maxsize=1)  # every step of an epoch slices one order; no step needs an older one
def _epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def step_samples(step: int, batch: int, n: int, seed: int) -> tuple[list[int], int]:
    """The global batch of a step: a slice of the epoch's seeded permutation (drop-last). The slice is a
    copy, so no caller can change the cached order."""
    epoch, k = divmod(step, n // batch)
    return _epoch_order(seed, epoch, n)[k * batch : (k + 1) * batch], epoch


def lr_lambda(total: int):
    warmup = max(1, min(100, total // 20))

    def f(step: int) -> float:  # linear warm-up, then cosine down to 10 %
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return f


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


def train(cfg: TrainConfig, resume_dir: Path | None = None, console=None) -> dict:
    cfg.validate()
    fabric, accelerator, precision, strategy = make_fabric(cfg)
    # Rank 0 claims the run directory (a default name comes from the clock) and checks it; all ranks
    # learn the answer, so a refusal stops every process instead of leaving the others waiting.
    choice, claim = None, None
    if fabric.is_global_zero:
        try:
            claim = RunClaim.resume(resume_dir) if resume_dir else RunClaim.new(cfg)
            choice = str(claim.path)
        except GpuwiseError as e:
            choice = GpuwiseError(str(e))
    choice = fabric.broadcast(choice, src=0)
    if isinstance(choice, GpuwiseError):
        raise choice
    rec = Recorder(Path(choice), fabric.is_global_zero)
    try:
        return _train(cfg, fabric, accelerator, precision, strategy, rec, resume_dir is not None, console)
    except BaseException:
        rec.close()
        if claim is not None:
            claim.discard_if_unused()  # silently: the error says what went wrong, and nothing was lost
        raise
    finally:
        if claim is not None:
            claim.release()


def _train(cfg, fabric, accelerator, precision, strategy, rec: Recorder, resuming: bool, console) -> dict:
    run_dir = rec.run_dir
    fabric.seed_everything(cfg.seed, verbose=False)

    from gpuwise.workloads import build

    work = build(cfg, run_dir)
    for key, value in work.defaults.items():
        if getattr(cfg, key, None) is None:
            setattr(cfg, key, value)
    rec.save_config(cfg)
    world = fabric.world_size
    if cfg.batch_size % world:
        raise GpuwiseError(f"--batch-size {cfg.batch_size} must be divisible by the {world} processes")
    share = cfg.batch_size // world
    steps_per_epoch = work.train_size // cfg.batch_size
    if steps_per_epoch == 0:
        raise GpuwiseError(f"--batch-size {cfg.batch_size} is larger than the {work.train_size} training samples")
    total = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    ckpt_every = cfg.checkpoint_every or max(1, total // 10)

    model = work.model
    # FSDP shards the model in place, yet the saved model must be whole: rank 0 keeps an unsharded
    # twin (one more copy in host memory) to load the gathered weights into at the end.
    twin = copy.deepcopy(model) if strategy == "fsdp" and fabric.is_global_zero else None
    # The optimizer is made after setup, because FSDP replaces the parameters by their shards.
    model = fabric.setup_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=work.defaults.get("weight_decay", 0.01))
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total))

    def micro_losses(step: int, micro: int) -> float:
        """Forward and backward of this process's slice of the step, micro-batch by micro-batch."""
        samples, epoch = step_samples(step, cfg.batch_size, work.train_size, cfg.seed)
        mine = samples[fabric.global_rank * share : (fabric.global_rank + 1) * share]
        chunks = [mine[i : i + micro] for i in range(0, len(mine), micro)]
        total_loss = 0.0
        for i, chunk in enumerate(chunks):
            batch = fabric.to_device(work.make_batch(chunk, epoch))
            with fabric.no_backward_sync(model, enabled=i < len(chunks) - 1):
                loss = work.loss(model, batch) * (len(chunk) / len(mine))
                fabric.backward(loss)
            total_loss += loss.item()
        return total_loss

    # --- resume ---------------------------------------------------------------------------
    step, micro, oom_events, elapsed_before = 0, cfg.micro_batch_size, [], 0.0
    if resuming:
        restored = _restore(fabric, run_dir, model, optimizer, scheduler)
        if restored is None:
            say(fabric, f"gpuwise: {run_dir} has no checkpoint yet: starting it from step 0")
        else:
            step, micro, oom_events, elapsed_before = restored
        rec.rewind(step)

    # --- measure one step (FLOPs, saved activations), then fit the micro-batch to memory -----
    raw = model.module if hasattr(model, "module") else model
    rng = rng_state()
    probe_n = min(share, 4)
    flops, saved = measure.probe_step(raw, work.loss, fabric.to_device(work.make_batch(list(range(probe_n)), 0)))
    flops_per_sample, saved_per_sample = flops / probe_n, saved / probe_n
    states = measure.state_bytes(raw)
    estimate = lambda m: states + saved_per_sample * m  # noqa: E731
    if micro is None:
        budget = fit.available_bytes(accelerator, fabric.local_rank if accelerator == "cuda" else 0)
        micro = fit.largest_fitting(share, estimate, int(budget * 0.9) if budget else None)
        if accelerator == "cuda":
            micro = fit.probe(micro, lambda m: (micro_losses(step, m), optimizer.zero_grad(set_to_none=True)))
    micro = min(micro, share)
    set_rng_state(rng)
    peak, peak_origin = measure.peak_flops(accelerator, precision, fabric.local_rank)
    flops_per_step = flops_per_sample * cfg.batch_size
    device_key = measure.device_key(accelerator, fabric.local_rank)
    trainable = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    prepare = lambda: work.make_batch(list(range(share)), 0)  # noqa: E731
    plan = {"peak_bytes": int(estimate(micro))}
    plan |= measure.step_time_plan(device_key, cfg.workload, flops_per_step, peak, world, share, trainable, prepare)
    time_method = plan.pop("time_method")
    plan["method"] = f"model states + activations saved for backward, counted on one micro-batch; time = {time_method}"
    if work.model_spec is not None:
        plan |= analytic_plan(work, cfg, micro, precision)

    # --- train ----------------------------------------------------------------------------
    inject, stop = fit.OOMInjector(), StopFlag()
    mem = measure.PeakMemory(accelerator, sum(p.numel() * p.element_size() for p in raw.parameters()))
    progress = _progress(console, total, step) if fabric.is_global_zero and console else None
    times, loss_value, t_run = [], float("nan"), time.perf_counter()
    before = None
    if work.eval_before and step == 0:
        before = work.evaluate(model, fabric.device)
        rec.log(0, **{f"eval/{k}": v for k, v in _scalars(before).items()})
    try:
        while step < total:
            t0 = time.perf_counter()
            rng = forward_rng()  # torch's generators only: the forward's dropout is all that draws from them
            while True:
                try:
                    inject.check(step, micro)
                    loss_value = micro_losses(step, micro)
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
            times.append(time.perf_counter() - t0)
            rec.log(
                step,
                loss=loss_value,
                lr=scheduler.get_last_lr()[0],
                step_time_s=times[-1],
                samples_per_s=cfg.batch_size / times[-1],
                micro_batch=micro,
            )
            if progress:
                progress[0].update(progress[1], completed=step, loss=loss_value, sps=cfg.batch_size / times[-1])
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                rec.log(step, **{f"eval/{k}": v for k, v in _scalars(work.evaluate(model, fabric.device)).items()})
            stopping = stop.signal is not None
            if world > 1:  # one process's signal stops them all, at the same step
                flag = torch.tensor(float(stopping), device=fabric.device)
                stopping = bool(fabric.all_reduce(flag, reduce_op="sum").item())
            if step % ckpt_every == 0 or step == total or stopping:
                state = {
                    "model": model,
                    "optimizer": optimizer,
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "micro_batch": micro,
                    "rng": rng_state(),
                    "oom_events": oom_events,
                    "precision": fabric.strategy.precision.state_dict(),
                    "data": {"epoch": step // steps_per_epoch, "offset": (step % steps_per_epoch) * cfg.batch_size},
                    "elapsed": elapsed_before + time.perf_counter() - t_run,
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
    peak_bytes = mem.read()  # before evaluation, whose batches are not the training step's

    # --- evaluate, save, summarize -------------------------------------------------------------
    evaluation = work.evaluate(model, fabric.device)
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if twin is not None:
            twin.load_state_dict(whole)
            raw = twin
    files = work.save(raw, run_dir) if fabric.is_global_zero else []
    fabric.barrier()
    from gpuwise.train.summary import summarize

    return summarize(
        cfg,
        rec,
        rank_zero=fabric.is_global_zero,
        device_key=device_key,
        run_dir=run_dir,
        times=times,
        steps=step,
        steps_per_epoch=steps_per_epoch,
        final_loss=loss_value,
        evaluation=evaluation,
        baseline=work.baseline,
        before=before,
        tokens_per_sample=work.tokens_per_sample,
        info=work.info,
        flops_per_step=flops_per_step,
        peak=peak,
        peak_origin=peak_origin,
        accelerator=accelerator,
        world=world,
        precision=precision,
        strategy=strategy,
        micro=micro,
        share=share,
        oom_events=oom_events,
        plan=plan,
        peak_bytes=peak_bytes,
        memory_method=mem.method,
        files=files,
        elapsed_before=elapsed_before,
        started=t_run,
    )


def _restore(fabric, run_dir: Path, model, optimizer, scheduler):
    """Load the newest checkpoint that is whole and loads; (step, micro-batch, OOM events, elapsed), or None
    when the run has no checkpoint. Each one skipped gets one line: a corrupt file, or one that passes
    its checksum yet does not load (a planted pickle, a state of another shape)."""
    found = False
    for path, why in checkpoint.candidates(run_dir / "checkpoints"):
        found = True
        if why is None:
            try:
                rest = checkpoint.load(fabric, path, {"model": model, "optimizer": optimizer})
                scheduler.load_state_dict(rest["scheduler"])
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
                return restored
        say(fabric, f"gpuwise: checkpoint {path.name} is corrupt ({why}); using the one before it")
    if found:
        raise GpuwiseError(f"{run_dir}: no usable checkpoint to resume from (each one above is corrupt)")
    return None


def analytic_plan(work, cfg, micro: int, precision: str) -> dict:
    """For transformer workloads: the same figures from `gpuwise plan`'s analytic model."""
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
    return {"peak_bytes": int(mem.total - mem.overhead), "method": "gpuwise plan's analytic model (no CUDA overhead)"}


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


def resume(run_dir: Path, console=None) -> dict:
    if not run_dir.is_dir():  # before load_config, so that the message names the flag
        raise GpuwiseError(f"--resume {run_dir}: no such run directory")
    return train(load_config(run_dir), resume_dir=run_dir, console=console)
