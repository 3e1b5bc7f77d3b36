"""Macro benchmarks: one training step of each workload's model at a fixed size, on synthetic inputs of
the real shapes (data loading is not what is measured here), in the precision `gpuwise train` would
pick on the device (bf16 autocast on a bf16 GPU, fp32 on the CPU)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn


def _place(model, device):
    # On fake tensors (the traced planner) a module cannot be moved: it stays where it was built.
    return model if device.type == "cpu" else model.to(device)


def _defects(device, batch: int = 32):
    from gpuwise.workloads.defects import DefectCNN

    model = _place(DefectCNN(), device)
    x, y = torch.randn(batch, 1, 128, 128, device=device), torch.rand(batch, device=device)
    return model, lambda: nn.functional.binary_cross_entropy_with_logits(model(x).float(), y), batch, None


def _recommender(device, batch: int = 1024):
    from gpuwise.workloads.recommender import MatrixFactorization, bpr_loss

    model = _place(MatrixFactorization(671, 9066), device)  # MovieLens' users and movies
    g = torch.Generator().manual_seed(0)
    u, i, j = (torch.randint(0, n, (batch,), generator=g).to(device) for n in (671, 9066, 9066))
    return model, lambda: bpr_loss(model, u, i, j), batch, None


def _product_lm(device, batch: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.workloads.product_lm import SMALL_LLAMA

    model = _place(LlamaForCausalLM(LlamaConfig(vocab_size=4096, max_position_embeddings=512, **SMALL_LLAMA)), device)
    ids = torch.randint(0, 4096, (batch, 128), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(input_ids=ids, labels=ids).loss.float(), batch, 128


WORKLOADS = {"defects": _defects, "recommender": _recommender, "product-lm": _product_lm}


def throughput(name: str, device: torch.device, steps: int, min_time: float = 0.0, batch: int | None = None) -> dict:
    """At least `steps` timed steps and at least `min_time` seconds of them: a millisecond step
    needs many to give a stable median."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, loss_fn, samples, tokens = WORKLOADS[name](device, *([batch] if batch else []))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as gpuwise train's step does
        opt.step()
        opt.zero_grad(set_to_none=True)

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    times = []
    while len(times) < steps or sum(times) < min_time:
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    typical = float(np.median(times))  # sustained, not best-case: calibration plans whole runs from it
    out = {
        "samples_per_s": samples / typical,
        "step_s": typical,
        "flops_per_step": float(counter.get_total_flops()),
        "precision": "bf16-mixed" if bf16 else "32-true",
        "batch": samples,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    out["tflops"] = out["flops_per_step"] / typical / 1e12
    if tokens:
        out["tokens_per_s"] = samples * tokens / typical
    return out
