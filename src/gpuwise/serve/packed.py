"""bf16 linear layers prepacked for oneDNN, for inference on a CPU.

In bf16 on a CPU, `F.linear` hands oneDNN a plain [out, in] weight, which oneDNN reorders into its blocked
AMX / AVX512-BF16 layout on every call: at the small batches of decoding that reorder costs more than the
product. Reordered once at load, SmolLM2's products ran 1.3-2.8x faster on 2 Xeon cores with AMX (batch 1
and 32), and a whole decode step 1.11x / 1.24x / 1.19x faster at batch 1 / 8 / 32
(`benchmarks/engine_step.py`, interleaved in one process), with results bitwise equal to `F.linear` for a
contiguous input (tests/test_packed.py).

This is what `ipex.optimize` and inductor's freezing pass do. IPEX is retired, and torch.compile took
six minutes to compile SmolLM2-135M on this machine for a smaller gain (60-76 ms per batch-32 step,
against 52-57 ms packed), so the two oneDNN ops inductor emits are called directly. They are private
to PyTorch (`torch.ops.mkldnn`): `packable` checks they are there, and nothing is packed where they are not.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("gpuwise.serve")


def packable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this PyTorch build packs bf16 linears for oneDNN on this device."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return bool(ops._is_mkldnn_bf16_supported()) and all(
            hasattr(ops, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An [out, in] bf16 weight in oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the weight packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An inference-only stand-in for an `nn.Linear`: the weight lives in oneDNN's blocked layout (an opaque
    tensor: no autograd, no `.to()`, no state dict), the bias as it was."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


def pack_linears(model: nn.Module) -> tuple[int, int]:
    """Replace every bf16 `nn.Linear` of `model` by a `PackedLinear`, in place; (layers packed, bytes added).

    LoRA's own A and B matrices stay as they are (rank r: nothing to gain, and peft reads their weights);
    peft calls the base layer it wraps as a module, so a packed base serves every adapter. A weight that
    another module still holds (an output layer tied to the embedding) is now held twice: the bytes added."""
    held = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    packed = added = 0
    for name, parent in list(model.named_modules()):
        if "lora_" in name:
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.bfloat16:
                continue
            setattr(parent, child_name, PackedLinear(child))
            packed += 1
            if id(child.weight) in held:
                added += child.weight.numel() * child.weight.element_size()
    log.info("oneDNN-packed %d bf16 linear layers (%.0f MB held twice: tied weights)", packed, added / 1e6)
    return packed, added
