"""What the loop measures beside training: FLOPs and saved-activation bytes of one step, the
device's peak, and peak memory (CUDA's allocator, or the process's resident high-water mark)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuwise.hardware.catalog import load_catalog, match_device
from gpuwise.hardware.cpu import detect_cpu, release_freed_memory
from gpuwise.plan.optim import adamw
from gpuwise.plan.request import EFFICIENCY
from gpuwise.runs.db import calibration, workload_key
from gpuwise.workloads.registry import get


def probe_step(model, loss_fn, batch: dict) -> tuple[float, int]:
    """FLOPs of one forward+backward (torch's FlopCounterMode) and the bytes autograd saves for
    backward (saved-tensor hooks). Gradients are cleared afterwards; the caller restores RNG."""
    from torch.utils.flop_counter import FlopCounterMode

    # Parameters cost nothing new. Each other storage counts once, for the distinct views of it saved, at most
    # its size: a storage that holds more than was saved of it (FSDP's all-gather buffer, of which one weight is
    # saved) is not all the step's, and views of one tensor (a transpose, q, k and v split) are not counted twice.
    views: dict[int, tuple[int, set]] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: a fake tensor has no data pointer
            views.setdefault(key, (storage.nbytes(), set()))[1].add((t.storage_offset(), t.numel(), t.element_size()))
        return t

    counter = FlopCounterMode(display=False)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model, batch).backward()
    for p in model.parameters():
        p.grad = None
    saved = sum(min(size, sum(n * e for _, n, e in seen)) for size, seen in views.values())
    return float(counter.get_total_flops()), saved


def stored_bytes(p) -> int:
    """A parameter's bytes as stored: its elements, or what a model planned on fake tensors says it will
    take (`stored_bytes`: an NF4 weight, half a byte each, as bitsandbytes stores it)."""
    return getattr(p, "stored_bytes", p.numel() * p.element_size())


def state_bytes(model, optimizer_state_per_param: int = 8) -> int:
    """Weights + gradients + AdamW moments of the trainable parameters (fp32 moments)."""
    total = 0
    for p in model.parameters():
        total += stored_bytes(p)
        if p.requires_grad:
            total += p.numel() * (p.element_size() + optimizer_state_per_param)
    return total


def _cuda_row(device_index: int):
    """(torch's name for the GPU, its catalog row or None)."""
    name = torch.cuda.get_device_name(device_index)
    return name, match_device(load_catalog(), name)


def peak_flops(accelerator: str, precision: str, device_index: int = 0) -> tuple[float | None, str]:
    """Dense peak FLOP/s of one device at the training precision, and where the figure comes from."""
    low = precision.startswith(("bf16", "16"))
    if accelerator == "cuda":
        name, acc = _cuda_row(device_index)
        if acc is None:
            return None, f"{name} is not in the catalog"
        tflops = (acc.bf16_tflops if precision.startswith("bf16") else acc.fp16_tflops) if low else acc.fp32_tflops
        return (tflops * 1e12 if tflops else None), f"catalog {acc.slug} dense {'16-bit' if low else 'fp32'} peak"
    if accelerator == "cpu":
        cpu = detect_cpu()
        gflops = cpu.bf16_peak_gflops if low and cpu.bf16_peak_gflops else cpu.fp32_peak_gflops
        return (gflops * 1e9 if gflops else None), f"CPU derived peak: {cpu.derivation}"
    return None, f"no peak known for {accelerator}"


def device_key(accelerator: str, device_index: int = 0) -> str:
    """How the run record names this device: cpu:<model> or cuda:<catalog slug>."""
    if accelerator == "cuda":
        name, acc = _cuda_row(device_index)
        return f"cuda:{acc.slug if acc else name}"
    if accelerator == "cpu":
        return f"cpu:{detect_cpu().model}"
    return accelerator


def step_efficiency(device: str, workload: str, precision: str) -> tuple[float, str]:
    """The share of peak this workload's step reached in `gpuwise bench` on this device at this precision,
    else the default."""
    found = calibration(device, workload_key(workload, precision))
    return found or (EFFICIENCY.value, EFFICIENCY.origin)


def timed_step(device: str, workload: str, precision: str, samples: int, params: int) -> tuple[float, str] | None:
    """Seconds per step from what `gpuwise bench` timed on this device, a part per sample and a part
    per trainable parameter: the time model for a step torch counts no FLOPs in (a ranking model's
    embedding lookups and dot products). None before bench has run here."""
    key = workload_key(workload, precision)
    per_sample = calibration(device, f"{key}.s_per_sample")
    per_param = calibration(device, f"{key}.s_per_param")
    if not (per_sample and per_param):
        return None
    return per_sample[0] * samples + per_param[0] * params, per_sample[1].replace(".s_per_sample", "")


def per_step_part(device: str, workload: str, precision: str) -> tuple[float, float, str] | None:
    """(seconds per step, share of peak of the FLOPs beyond it, origin) where `gpuwise bench` timed this
    workload's step at two batch sizes on this device at this precision; None before that."""
    key = workload_key(workload, precision)
    fixed = calibration(device, f"{key}.s_per_step")
    marginal = calibration(device, f"{key}.flop_fraction")
    if not (fixed and marginal):
        return None
    return fixed[0], marginal[0], fixed[1].replace(".s_per_step", "")


def planned_step_time(flops_per_step: float, peak: float | None, processes: int, efficiency: float) -> float | None:
    return flops_per_step / (peak * efficiency * processes) if peak else None


def step_time_plan(
    device: str,
    workload: str,
    precision: str,
    flops: float,
    peak: float | None,
    processes: int,
    samples: int,
    params: int,
    prepare,
) -> dict:
    """The planned step time and what it rests on: counted FLOPs over the peak at the (calibrated)
    efficiency, after bench's seconds per step where it timed two batch sizes; where torch counts no
    FLOPs, bench's seconds per sample and per parameter; plus the time `prepare()` takes to build one
    batch, timed here rather than estimated."""
    efficiency, origin = step_efficiency(device, workload, precision)
    plan: dict[str, Any] = {
        "step_time_s": planned_step_time(flops, peak, processes, efficiency) if flops else None,
        "efficiency": efficiency,
        "efficiency_origin": origin,
        "time_method": "FLOPs / (peak x efficiency)",
    }
    split = per_step_part(device, workload, precision) if flops and peak else None
    if split and peak:
        fixed, marginal, split_origin = split
        plan |= {"efficiency": marginal, "efficiency_origin": f"{split_origin}, at two batch sizes"}
        plan["step_time_s"] = fixed + flops / (peak * marginal * processes)
        plan["time_method"] = f"{fixed * 1e3:.1f} ms per step + FLOPs / (peak x efficiency)"
    timed = None if flops else timed_step(device, workload, precision, samples, params)
    if timed:
        plan |= {"step_time_s": timed[0], "efficiency": None, "efficiency_origin": None, "time_origin": timed[1]}
        plan["time_method"] = f"s/sample x samples + s/parameter x parameters ({timed[1]})"
    if plan["step_time_s"]:
        t = time.perf_counter()
        prepare()
        plan["data_s"] = time.perf_counter() - t
        plan["step_time_s"] += plan["data_s"]
        plan["time_method"] += " + data preparation timed on one batch"
    return plan


class PeakMemory:
    """CUDA: the caching allocator's peak. CPU: growth of the resident set's high-water mark (Linux
    VmHWM, reset through /proc/self/clear_refs) plus the weights already resident at the start."""

    def __init__(self, accelerator: str, resident_bytes: int):
        self.accelerator, self.resident = accelerator, resident_bytes
        self.method = None
        self.peak_before_pause = 0
        if accelerator == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.method = "torch.cuda.max_memory_allocated"
        elif self._reset_hwm():
            self.base = self._status("VmRSS")
            self.method = "process resident high-water growth + weights (Linux VmHWM)"

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def _reset_hwm(self) -> bool:
        try:
            release_freed_memory()  # memory kept from set-up would hide the steps' own growth
            Path("/proc/self/clear_refs").write_text("5")
            self._status("VmHWM")
            return True
        except (OSError, KeyError):
            return False

    def _now(self) -> int | None:
        if self.accelerator == "cuda":
            return int(torch.cuda.max_memory_allocated())
        if self.method is None:
            return None
        return max(0, self._status("VmHWM") - self.base) + self.resident

    def read(self) -> int | None:
        now = self._now()
        return None if now is None else max(now, self.peak_before_pause)

    @contextlib.contextmanager
    def paused(self):
        """Leave what runs inside (an evaluation, whose batches are not the training step's) out of the peak."""
        self.peak_before_pause = self.read() or 0
        try:
            yield
        finally:
            if self.accelerator == "cuda":
                torch.cuda.reset_peak_memory_stats()
            elif self.method is not None:
                self._reset_hwm()


class StepPeak:
    """The peak tensor memory of one real training step, counted as the plan counts it: on CUDA the caching
    allocator's allocated peak (reset as the step starts); on the CPU the tensors the step starts with and
    keeps (`state`: weights, buffers, optimizer states) plus the highest sum of what the step allocates and
    frees, from the profiler's allocation events. None elsewhere."""

    def __init__(self, accelerator: str, state: Callable[[], int] | None = None):
        self.accelerator = accelerator
        self.state = state
        self.bytes: int | None = None
        self.method = {
            "cuda": "torch.cuda.max_memory_allocated over one step",
            "cpu": "the profiler's allocations over one step, on top of the model's and optimizer's states (tensors)",
        }.get(accelerator)

    def __enter__(self):
        if self.accelerator == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self.accelerator == "cpu":
            from torch.profiler import ProfilerActivity, profile

            assert self.state is not None, "a CPU step's peak needs the bytes it starts with"
            self._base = self.state()
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            # the whole step: the allocator warns of each block freed in it that was allocated before
            self._quiet = _quiet_stderr()
            self._quiet.__enter__()
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.accelerator == "cuda":
            torch.cuda.synchronize()
            self.bytes = int(torch.cuda.max_memory_allocated())
        elif self.accelerator == "cpu":
            try:
                self._prof.__exit__(*exc)
                if exc[0] is None:
                    self.bytes = self._base + allocation_peak(self._prof)
            finally:
                self._quiet.__exit__(None, None, None)

    def __call__(self, fn):
        with self:
            fn()
        return self.bytes


def held_bytes(model, optimizer) -> int:
    """Bytes of the tensors a training step starts with and keeps: the model's parameters and buffers (with
    a 4-bit weight's quantization constants) and the optimizer's states, each storage counted once. Gradients
    are not among them: the loop frees them (set_to_none) before each step."""
    seen: set[int] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if hasattr(t, "to_local"):  # a DTensor (FSDP): this process holds its shard
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
        quant = getattr(t, "quant_state", None)  # bitsandbytes' 4-bit weights: absmax and code beside them
        while quant is not None:
            for v in vars(quant).values():
                if torch.is_tensor(v):
                    add(v)
            quant = getattr(quant, "state2", None)  # nested (double) quantization's own constants
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper holds the torch optimizer
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                add(v)
    return total


@contextlib.contextmanager
def _quiet_stderr():
    """Mute file descriptor 2: the profiler's C++ side prints a line as it starts and stops, and a warning for
    each block freed under it that was allocated before it started, none of which a user should read."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocation_peak(prof) -> int:
    """The highest sum of bytes allocated minus bytes freed, in time order, over a finished CPU profile: what
    the step adds at its peak to the tensors it started with. Summed here from the profiler's raw allocation
    events because torch's memory timeline (`export_memory_timeline`), which gives the same peak to a few
    hundred bytes, rebuilds the step's whole data flow in Python first: 13-17 s for one LoRA step of a 135M
    model here, against 0.04 s for this sum."""
    from torch.autograd import DeviceType

    events = prof.profiler.kineto_results.events()
    deltas = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    live = peak = 0
    for _, delta in deltas:
        live += delta
        peak = max(peak, live)
    return peak


def real_step(workload: str) -> tuple[float, float]:
    """Peak tensor memory and FLOPs of one real training step of a workload's model (bench sizes), after a
    first step that creates the optimizer states. Memory: the profiler's allocations on top of the states
    (StepPeak), an independent check on the traced planner."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, loss_fn, _, _ = get(workload).bench_step(torch.device("cpu"))
    opt = adamw(model.parameters(), 1e-4, "cpu")

    def step():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    peak = StepPeak("cpu", lambda: held_bytes(model, opt))(step)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(peak or 0), float(counter.get_total_flops())
