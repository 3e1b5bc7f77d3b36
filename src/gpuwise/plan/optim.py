"""The optimizer of every training step gpuwise runs, plans or measures: `gpuwise train`, `plan --traced`,
`bench`'s macro step and the profiler's check. One factory, so the plan counts the optimizer the run uses."""

from __future__ import annotations


def adamw(params, lr: float, device_type: str, weight_decay: float = 0.01, sharded: bool = False):
    """The optimizer of every training step gpuwise runs or measures (train, bench, the profiler's check).
    The fused kernel updates all tensors in one pass instead of a Python loop over them (SmolLM2's LoRA has
    420; docs/benchmarks.md), as HF Trainer's default adamw_torch_fused does. FSDP's sharded parameters keep
    the default implementation."""
    import torch

    fused = device_type in ("cpu", "cuda") and not sharded
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
