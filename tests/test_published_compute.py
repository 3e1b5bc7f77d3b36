"""Compute and time against published figures (each figure with its source beside it)."""

import pytest

from gpuwise.plan.model import resolve_model
from gpuwise.plan.planner import make_plan
from gpuwise.plan.request import PlanRequest


@pytest.mark.parametrize("model,published_gpu_hours", [("llama-2-7b", 184_320), ("llama-2-70b", 1_720_320)])
def test_llama2_pretraining_gpu_hours_with_default_efficiency(catalog, model, published_gpu_hours):
    # Meta's model card: 2 T tokens on A100-80GB. Our FLOPs: 6*N*D + PaLM's attention term at seq 4096,
    # no recompute, at the default efficiency (PaLM's 46.2 % MFU). Tolerance +-5 %.
    req = PlanRequest(task="pretrain", tokens=2e12, seq=4096, gpu="a100-80gb", checkpointing="none")
    res = make_plan(resolve_model(model), req, catalog)
    assert res["compute"]["efficiency"] == 0.462
    assert res["compute"]["gpu_hours"] == pytest.approx(published_gpu_hours, rel=0.05)


def test_training_flops_are_6nd_plus_attention(catalog):
    # Transformer Math 101 / PaLM appendix B: 6*N*D + 12*L*H*Q*T*D, N without the input lookup. Exact.
    m = resolve_model("llama-2-7b")
    req = PlanRequest(task="pretrain", tokens=1e9, seq=2048, gpu="h100-sxm")
    flops = make_plan(m, req, catalog)["compute"]["flops"]
    n = m.params - m.vocab * m.hidden
    assert flops == pytest.approx((6 * n + 12 * m.layers * m.heads * m.head_dim * 2048) * 1e9, rel=1e-12)


def test_full_recompute_adds_a_forward_pass(catalog):
    # Transformer Math 101: full recompute adds 2*N*D (and the attention forward).
    m = resolve_model("llama-2-7b")
    base = dict(task="pretrain", tokens=1e9, seq=2048, gpu="h100-sxm")
    plain = make_plan(m, PlanRequest(**base), catalog)["compute"]
    full = make_plan(m, PlanRequest(**base, checkpointing="full"), catalog)["compute"]
    assert full["flops"] == plain["flops"]  # model FLOPs do not change
    n = m.params - m.vocab * m.hidden
    extra = (2 * n + 4 * m.layers * m.heads * m.head_dim * 2048) * 1e9
    assert full["hardware_flops"] - plain["hardware_flops"] == pytest.approx(extra, rel=1e-9)
    assert full["gpu_hours"] > plain["gpu_hours"]


def test_decode_is_bandwidth_bound_at_batch_1(catalog):
    # One sequence: every step streams all weights; tokens/s = bandwidth x 0.8 / weight bytes.
    m = resolve_model("llama-2-7b")
    res = make_plan(m, PlanRequest(task="inference", seq=128, gen=128, gpu="h100-sxm"), catalog)
    comp = res["compute"]
    assert comp["decode_bound"] == "memory"
    weights = m.params * 2
    kv = res["memory"]["kv_cache"] * (128 + 64) / 256
    assert 1 / comp["decode_step_s"] == pytest.approx(3350e9 * 0.8 / (weights + kv), rel=1e-9)


def test_large_batch_decode_becomes_compute_bound(catalog):
    m = resolve_model("llama-3.1-8b")
    res = make_plan(m, PlanRequest(task="inference", seq=128, gen=128, batch=1024, gpu="h100-sxm"), catalog)
    assert res["compute"]["decode_bound"] == "compute"


def test_lora_skips_weight_gradients_of_frozen_weights(catalog):
    m = resolve_model("llama-2-7b")
    common = dict(tokens=1e6, seq=512, gpu="h100-sxm")
    full = make_plan(m, PlanRequest(task="finetune", **common), catalog)["compute"]["flops"]
    lora = make_plan(m, PlanRequest(task="lora", **common), catalog)["compute"]["flops"]
    assert lora / full == pytest.approx(4 / 6, rel=0.03)  # 4N + 6T vs 6N; attention and 6T make the 3 %


def test_inference_reports_prefill_and_decode_flops_separately(catalog):
    # Forward FLOPs per token are 2*N plus attention (PaLM): prompt and generated tokens counted apart.
    m = resolve_model("llama-2-7b")
    comp = make_plan(m, PlanRequest(task="inference", seq=512, gen=128, tokens=128, gpu="h100-sxm"), catalog)["compute"]
    n = m.params - m.vocab * m.hidden
    attn = 4 * m.layers * m.heads * m.head_dim
    assert comp["prefill_flops"] == pytest.approx(512 * (2 * n + attn * 256))
    assert comp["decode_flops"] == pytest.approx(128 * (2 * n + attn * (512 + 64)))
    assert comp["flops"] == pytest.approx(comp["prefill_flops"] + comp["decode_flops"])


def test_resnet50_training_flops_behind_the_gpu_projection():
    # The projection of a CNN run uses Lambda's ResNet-50 images/s x the FLOPs of one training image;
    # recount them: transformers' ResNetConfig() is ResNet-50 (25.6 M parameters). Tolerance 0.1 %.
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import ResNetConfig, ResNetForImageClassification

    from gpuwise.hardware.reference import RESNET50_TRAIN_FLOPS

    model = ResNetForImageClassification(ResNetConfig(num_labels=1000))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(25.56e6, rel=1e-3)
    counter = FlopCounterMode(display=False)
    with counter:
        model(pixel_values=torch.randn(1, 3, 224, 224)).logits.sum().backward()
    assert counter.get_total_flops() == pytest.approx(RESNET50_TRAIN_FLOPS, rel=1e-3)
