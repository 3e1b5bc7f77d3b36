"""Linear layers whose weights are packed once for the CPU library that multiplies them, for inference.

Why: `F.linear` hands oneDNN (bf16, fp32) or MKL's GEMM (fp32) a plain [out, in] weight, which the library
reorders into its own blocked layout on every call; at the small batches of decoding that reorder costs more
than the product. Packed once at load, it is not repeated (docs/serving.md, "Linears packed once").

What it promises: in bf16 a packed product is bitwise `F.linear`'s for a contiguous input; in fp32 it may
sum in another order (the kernel depends on the CPU), so it is within float rounding of it, and a single row
may take another path than the same row in a batch (tests/test_packed.py). oneDNN's packing drops the plain
weight. MKL's packed GEMM, the fp32 fallback where this PyTorch has no oneDNN, keeps it beside a packed copy
several times its size, so `mkl_fits` packs only what takes under a quarter of the free memory, and products
of fewer than `MKL_MIN_ROWS` rows run `F.linear` on the plain weight.

This is what `ipex.optimize` and inductor's freezing pass do (IPEX is retired; torch.compile took minutes for
a smaller gain), so the ops inductor emits are called directly. They are private to PyTorch
(`torch.ops.mkldnn`, `torch.ops.mkl`): `packing` checks they are there, and nothing is packed where they are not.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("gpuwise.serve")

ONEDNN, MKL = "oneDNN", "MKL"

# Products of fewer rows run F.linear on the plain weight: below 4 rows MKL's packed product is the slower of
# the two (docs/benchmarks.md).
MKL_MIN_ROWS = 4


def packing(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Which packing this PyTorch build has for linears of `dtype` on `device`: ONEDNN, MKL or None."""
    if torch.device(device).type != "cpu":
        return None
    if onednn_packs(dtype):
        return ONEDNN
    if dtype == torch.float32 and mkl_packs():
        return MKL
    return None


def onednn_packs(dtype: torch.dtype) -> bool:
    try:
        ops = torch.ops.mkldnn
        if not torch.backends.mkldnn.is_available() or dtype not in (torch.bfloat16, torch.float32):
            return False
        if dtype == torch.bfloat16 and not ops._is_mkldnn_bf16_supported():
            return False
        return all(hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def mkl_packs() -> bool:
    try:
        mkl_ops = ("_mkl_reorder_linear_weight", "_mkl_linear")
        return torch.backends.mkl.is_available() and all(hasattr(torch.ops.mkl, op) for op in mkl_ops)
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=64)
def _mkl_bytes(out_features: int, in_features: int) -> int:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros(out_features, in_features), 1)
    return packed.numel() * packed.element_size()


def mkl_bytes(model: nn.Module) -> int:
    """What packing `model`'s fp32 linear layers for MKL would add (LoRA's own matrices are not packed)."""
    return sum(
        _mkl_bytes(m.out_features, m.in_features)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and "lora_" not in name
    )


def mkl_fits(model: nn.Module, free_bytes: int) -> tuple[bool, str]:
    """Whether MKL's packed copies of `model`'s linears take under a quarter of `free_bytes`; and why not."""
    need = mkl_bytes(model)
    if need <= free_bytes // 4:
        return True, ""
    return False, f"MKL's packed weights would take {need / 1e9:.1f} GB, over a quarter of {free_bytes / 1e9:.1f} GB"


class Packed:
    """One weight packed for `kind` (ONEDNN or MKL), and its product `F.linear(x, weight, bias)`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str):
        self.kind, self.bias = kind, bias
        self.out_features = weight.shape[0]
        if kind == ONEDNN:
            self.packed, self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None), None
            self.added = 0
        elif kind == MKL:
            # the row count given here is not used for a packed weight (the same copy serves every count)
            self.packed, self.weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_MIN_ROWS), weight
            self.added = self.packed.numel() * self.packed.element_size()
        else:
            raise ValueError(f"no packing {kind!r}: one of {ONEDNN}, {MKL}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        assert self.weight is not None  # MKL's packing keeps it
        if rows < MKL_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, self.packed, self.weight, self.bias, rows)
        return out.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """An inference-only stand-in for an `nn.Linear` whose weight is packed (an opaque tensor: no autograd,
    no `.to()`, no state dict); the bias as it was."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self.product = Packed(linear.weight.detach(), bias, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.product.kind}-packed"


def pack_linears(model: nn.Module, kind: str) -> tuple[int, int]:
    """Replace every `nn.Linear` of `model` in `kind`'s dtype by a `PackedLinear`, in place; (layers packed,
    bytes added).

    LoRA's own A and B matrices stay as they are (rank r: nothing to gain, and peft reads their weights);
    peft calls the base layer it wraps as a module, so a packed base serves every adapter. Bytes added: MKL's
    packed copies; for oneDNN, a weight that another module still holds (an output layer tied to the
    embedding), now held twice."""
    dtypes = {ONEDNN: (torch.bfloat16, torch.float32), MKL: (torch.float32,)}[kind]
    held = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    packed = added = 0
    for name, parent in list(model.named_modules()):
        if "lora_" in name:
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype not in dtypes:
                continue
            layer = PackedLinear(child, kind)
            setattr(parent, child_name, layer)
            packed += 1
            added += layer.product.added
            if kind == ONEDNN and id(child.weight) in held:
                added += child.weight.numel() * child.weight.element_size()
    log.info("%s-packed %d linear layers (+%.0f MB)", kind, packed, added / 1e6)
    return packed, added
