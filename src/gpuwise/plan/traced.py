"""The traced planner: any PyTorch model, planned by running one training step on fake tensors.

The model and its batch are built under FakeTensorMode (shapes and dtypes, no memory, no compute);
one step (forward, backward, AdamW) runs untracked so the optimizer states exist, then a second runs
under torch's MemTracker (peak memory by category), FlopCounterMode (FLOPs) and a roofline counter
(time). Only this path imports torch; `gpuwise plan` without --traced never does.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.catalog import Accelerator
from gpuwise.plan.optim import adamw
from gpuwise.plan.request import ALLOCATOR_SLACK, EFFICIENCY, OVERHEAD_BYTES
from gpuwise.plan.sharding import fully_shard_model
from gpuwise.results import TracedPlan


class Roofline(TorchDispatchMode):
    """Per operation: max(FLOPs / peak, bytes moved / bandwidth), summed. torch's RuntimeEstimator has
    a roofline mode too, but it insists on a CUDA device; this is that counter, small enough to own."""

    def __init__(self, peak_flops: float, bandwidth: float):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry, self.peak, self.bandwidth = flop_registry, peak_flops, bandwidth
        self.seconds = self.flops = self.bytes = 0.0
        self.ops: list[tuple[float, float]] = []  # (FLOPs, bytes) per op: the same step priced on other devices

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        moved = (
            0
            if func.is_view
            else sum(
                t.numel() * t.element_size()
                for t in tree_flatten((args, kwargs, out))[0]
                if isinstance(t, torch.Tensor)
            )
        )
        self.flops += flops
        self.bytes += moved
        self.seconds += max(flops / self.peak, moved / self.bandwidth)
        self.ops.append((flops, moved))
        return out

    def seconds_on(self, peak_flops: float, bandwidth: float) -> float:
        """The roofline time of the counted ops on another device."""
        return sum(max(f / peak_flops, b / bandwidth) for f, b in self.ops)


@dataclass
class Traced:
    name: str
    memory: dict[str, float]  # bytes per GPU: weights, gradients, optimizer, activations, overhead, total
    flops: float  # one training step
    bytes_moved: float
    roofline_s: float


def _loss_of(output) -> torch.Tensor:
    """A user's model may return a loss (HF), a tensor or a tuple: a scalar to backpropagate from."""
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, tuple | list):
        output = output[0]
    if getattr(output, "logits", None) is not None:
        output = output.logits
    return output.float().mean()


def module_factory(spec: str):
    """``package.module:factory`` -> a callable returning (model, example batch)."""
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise GpuwiseError(f"--module {spec}: expected package.module:factory")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:  # ValueError: an empty or relative module name
        raise GpuwiseError(f"--module {spec}: {first_line(e)}") from None
    except Exception as e:  # the module ran on import, and failed: the user's code, as one line
        raise GpuwiseError(f"--module {spec}: importing it failed: {first_line(e)}") from None

    def build():
        made = factory()
        if not (isinstance(made, tuple | list) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
            raise GpuwiseError(f"--module {spec}: the factory must return (model, example batch), a torch module first")
        model, batch = made
        if isinstance(batch, dict):
            return model, lambda: _loss_of(model(**batch))
        if isinstance(batch, tuple | list):
            return model, lambda: _loss_of(model(*batch))
        return model, lambda: _loss_of(model(batch))

    return build


# Tracing steps through every layer in Python, seconds of CPU each: the largest published dense models have
# 126 to 160 layers, and past this a typo would hold the terminal for hours.
MAX_TRACED_LAYERS = 256
# torch counts a tensor's elements in a signed 64-bit integer, even for a fake tensor.
MAX_ELEMENTS = 2**62
# The fake process group costs milliseconds per rank to set up and shard over, so a six-figure rank count
# takes minutes; the analytic sweep stops at 4096 GPUs as well, and FSDP past that is run hybrid-sharded.
MAX_TRACED_SHARDS = 4096


def spec_factory(spec, batch: int, seq: int):
    """A transformers model from the analytic planner's ModelSpec (Llama-style families)."""
    if spec.family not in ("llama", "mistral", "qwen2", "custom") or not spec.gated or spec.linear_bias:
        raise GpuwiseError(
            f"traced planning builds Llama-style models; {spec.name} is {spec.family}: "
            "use the analytic planner, or --module with your own factory"
        )
    if spec.layers > MAX_TRACED_LAYERS:
        raise GpuwiseError(
            f"--traced steps through every layer (seconds each): {spec.name} has {spec.layers}, the most it "
            f"traces is {MAX_TRACED_LAYERS}; plan it without --traced"
        )
    largest = {  # the widest tensors of an eager Llama step
        "attention scores": batch * spec.heads * seq * seq,
        "logits": batch * seq * spec.vocab,
        "MLP activations": batch * seq * spec.ffn,
    }
    for what, n in largest.items():
        if n > MAX_ELEMENTS:
            raise GpuwiseError(
                f"--traced: the {what} of --batch {batch} x --seq {seq} would hold {n:.3g} elements, more than "
                "torch can count (2**63); plan it without --traced"
            )
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if spec.qkv_bias else (LlamaConfig, LlamaForCausalLM)
    # transformers' stub is narrower than its runtime: Qwen2Config's dataclass signature lists no head_dim,
    # yet it keeps the keyword (as every PreTrainedConfig keeps extra ones) and the model reads it.
    config = config_cls(  # type: ignore[call-arg]
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=spec.tied,
        max_position_embeddings=max(seq, 16),
    )
    # Eager attention: its QK^T and AV are plain matmuls that the FLOP formulas see; a fused SDPA kernel
    # on the CPU has no formula registered and would count as zero.
    config._attn_implementation = "eager"

    def build():
        model = model_cls(config)
        ids = torch.zeros(batch, seq, dtype=torch.long)
        return model, lambda: model(input_ids=ids, labels=ids).loss

    return build


@contextlib.contextmanager
def fake_process_group(world: int):
    """Rank 0 of `world` processes that do not exist: torch's fake backend answers every collective
    at once, so FSDP2 shards and FSDPMemTracker counts what one GPU of `world` would hold."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise GpuwiseError("sharded tracing starts its own (fake) process group: run it outside torchrun")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def _by_category(snap: dict) -> dict:
    """MemTracker's and FSDPMemTracker's categories, in the planner's parts."""
    by = {str(k).split(".")[-1]: v for k, v in snap.items()}
    part = lambda *keys: sum(by.get(k, 0) for k in keys)  # noqa: E731
    return {
        "weights": part("PARAM", "BUFFER", "SHARDED_PARAM", "UNSHARDED_PARAM"),
        "gradients": part("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD"),
        "optimizer": part("OPT"),
        # FSDP's all-gather and reduce-scatter buffers live with the activations: both scale with the step.
        "activations": part("ACT", "TEMP", "OTH", "INP", "ALL_GATHER", "REDUCE_SCATTER"),
        "tensors": by.get("Total", 0),
    }


def trace(name: str, build, acc: Accelerator, precision: str, shards: int = 1) -> Traced:
    peak = acc.peak_tflops(precision)
    if not peak:
        raise GpuwiseError(f"no dense {precision} peak for {acc.name} in the catalog")
    if shards > MAX_TRACED_SHARDS:
        raise GpuwiseError(
            f"--traced shards over a fake process group, one rank at a time: at most {MAX_TRACED_SHARDS} "
            f"--gpus, not {shards:,}; plan larger jobs without --traced"
        )
    try:
        if shards > 1:
            with fake_process_group(shards) as mesh:
                return _trace(name, build, acc, precision, peak, mesh)
        return _trace(name, build, acc, precision, peak, None)
    except GpuwiseError:
        raise
    except Exception as e:  # a --module factory or model is the user's code: its error, as one line
        raise GpuwiseError(f"tracing {name} failed: {first_line(e)}") from None


def _trace(name: str, build, acc: Accelerator, precision: str, peak: float, mesh) -> Traced:
    roof = Roofline(peak * 1e12, acc.mem_bw_gbs * 1e9)
    memory = traced_step(build, precision, mesh, roof)
    tensors = memory.pop("tensors") or sum(memory.values())
    memory["overhead"] = OVERHEAD_BYTES.value + ALLOCATOR_SLACK.value * tensors
    memory["total"] = tensors + memory["overhead"]
    return Traced(name, memory, roof.flops, roof.bytes, roof.seconds)


def traced_step(
    build, precision: str, mesh=None, roof: TorchDispatchMode | None = None, device: str = "cpu", mode=None
) -> dict:
    """Peak memory by category (and "tensors", their sum at the peak) of the second of two training steps
    of `build()`'s (model, loss_fn), run on fake tensors (under `mode`, where the model is fake already);
    `roof` counts the second step's work."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    autocast = precision in ("bf16", "fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with mode or FakeTensorMode(allow_non_fake_inputs=True):
        model, loss_fn = build()
        if mesh is not None:
            model = fully_shard_model(model, mesh)  # as `gpuwise train --strategy fsdp` shards it
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = adamw(trainable, 1e-4, device, sharded=mesh is not None)  # the optimizer `gpuwise train` makes

        def step():
            with torch.autocast(device, dtype=dtype, enabled=autocast):
                loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the optimizer states now exist, as in every step after the first
        if mesh is None:
            tracker = MemTracker()
            tracker.track_external(model, opt)
        else:
            tracker = FSDPMemTracker(model, opt)
        with tracker, roof or contextlib.nullcontext():
            step()
    return _by_category(next(iter(tracker.get_tracker_snapshot("peak").values())))


def traced_run_memory(model, loss, batch: dict, precision: str, device: str, mode=None) -> int:
    """Peak tensor bytes of one training step of a run's own model (its weights copied as fake tensors, so
    no memory is taken; a model on fake tensors already, of FakeTensorMode `mode`, as it is) on `batch`: what
    `gpuwise train` plans for a model the analytic formulas do not cover. `loss(model, batch)` is the
    workload's loss; precision "bf16", "fp16" or "fp32"."""
    import copy

    def build():
        # under FakeTensorMode: every parameter and buffer of the copy becomes a fake tensor
        fake = model if mode is not None else copy.deepcopy(model)
        return fake, lambda: loss(fake, batch)

    return int(traced_step(build, precision, device=device, mode=mode)["tensors"])


def traced_plan(name: str, build, acc: Accelerator, precision: str, efficiency: float | None, shards: int = 1) -> dict:
    """The traced plan as JSON, checked against its declared shape (results.TracedPlan)."""
    t = trace(name, build, acc, precision, shards)
    eff, origin = (efficiency, "--efficiency") if efficiency else (EFFICIENCY.value, EFFICIENCY.origin)
    return TracedPlan.build(
        {
            "traced": True,
            "model": {"name": name},
            "gpu": acc.slug,
            "gpus": shards,
            "precision": precision,
            "memory": {k: int(v) for k, v in t.memory.items()},
            "capacity": acc.mem_bytes,
            "fits": t.memory["total"] <= acc.mem_bytes,
            "compute": {
                "flops_per_step": t.flops,
                "bytes_per_step": t.bytes_moved,
                "roofline_s": t.roofline_s,
                "efficiency": eff,
                "efficiency_origin": origin,
                "step_time_s": t.roofline_s / eff,
            },
            "method": (
                f"one training step of rank 0 of {shards} on fake tensors, FSDP2-sharded over a fake process "
                "group: torch FSDPMemTracker (peak by category); "
                if shards > 1
                else "one training step on fake tensors: torch MemTracker (peak by category); "
            )
            + "FlopCounter formulas per op, roofline max(FLOPs/peak, bytes/bandwidth) per op / efficiency"
            + ("; collectives' time not counted" if shards > 1 else ""),
        }
    ).dump()
