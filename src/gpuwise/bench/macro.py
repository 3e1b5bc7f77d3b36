"""Macro benchmarks: one training step of each workload's model at a fixed size, on synthetic inputs of
the real shapes (data loading is not what is measured here), in the precision `gpuwise train` would
pick on the device (bf16 autocast on a bf16 GPU, fp32 on the CPU)."""

from __future__ import annotations

import time

import torch
from torch import nn


def _place(model, device):
    # On fake tensors (the traced planner) a module cannot be moved: it stays where it was built.
    return model if device.type == "cpu" else model.to(device)


def _defects(device):
    from gpuwise.workloads.defects import DefectCNN

    model = _place(DefectCNN(), device)
    x, y = torch.randn(32, 1, 128, 128, device=device), torch.rand(32, device=device)
    return model, lambda: nn.functional.binary_cross_entropy_with_logits(model(x).float(), y), 32, None


def _recommender(device):
    from gpuwise.workloads.recommender import MatrixFactorization, bpr_loss

    model = _place(MatrixFactorization(671, 9066), device)  # MovieLens' users and movies
    g = torch.Generator().manual_seed(0)
    u, i, j = (torch.randint(0, n, (1024,), generator=g).to(device) for n in (671, 9066, 9066))
    return model, lambda: bpr_loss(model, u, i, j), 1024, None


def _product_lm(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.workloads.product_lm import SMALL_LLAMA

    model = _place(LlamaForCausalLM(LlamaConfig(vocab_size=4096, max_position_embeddings=512, **SMALL_LLAMA)), device)
    ids = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(0)).to(device)
    return model, lambda: model(input_ids=ids, labels=ids).loss.float(), 8, 128


WORKLOADS = {"defects": _defects, "recommender": _recommender, "product-lm": _product_lm}


def throughput(name: str, device: torch.device, steps: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, loss_fn, samples, tokens = WORKLOADS[name](device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    best = min(times)
    out = {
        "samples_per_s": samples / best,
        "step_s": best,
        "flops_per_step": float(counter.get_total_flops()),
        "precision": "bf16-mixed" if bf16 else "32-true",
        "batch": samples,
    }
    out["tflops"] = out["flops_per_step"] / best / 1e12
    if tokens:
        out["tokens_per_s"] = samples * tokens / best
    return out
