"""Linears packed once (serve/engines/gpuwise/packed.py), for oneDNN in bf16 and fp32 and for MKL in fp32 (the
fallback), compute what `F.linear` computes (bf16 bitwise, fp32 within 1e-5: see `same`): alone (MKL at
every row count from 1 to 40, one packed copy for all), in a tiny Llama with a tied output layer, and under two
LoRA adapters in one mixed batch; what is packed and what it adds is counted, and MKL's copies are packed only
where they fit."""

import copy

import pytest
import torch
from torch import nn

from gpuwise.serve.engines.gpuwise.packed import (
    MKL,
    MKL_MIN_ROWS,
    ONEDNN,
    PackedLinear,
    mkl_fits,
    mkl_packs,
    onednn_packs,
    pack_linears,
    packing,
)

onednn = pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="no oneDNN bf16 linear on this CPU")
onednn32 = pytest.mark.skipif(not onednn_packs(torch.float32), reason="no oneDNN in this PyTorch build")
mkl = pytest.mark.skipif(not mkl_packs(), reason="this PyTorch build has no MKL packed GEMM")
KINDS = [
    pytest.param(ONEDNN, torch.bfloat16, marks=onednn, id="oneDNN-bf16"),
    pytest.param(ONEDNN, torch.float32, marks=onednn32, id="oneDNN-fp32"),
    pytest.param(MKL, torch.float32, marks=mkl, id="MKL-fp32"),
]


def same(a: torch.Tensor, b: torch.Tensor, kind: str) -> bool:
    """bf16: bitwise. fp32: within 1e-5 of the largest output. oneDNN sums in another order than F.linear's
    GEMM (MKL's), and MKL's packed GEMM matched F.linear bitwise on one Xeon host and not on another (its
    kernel for 5 rows differs by the CPU it finds)."""
    if a.dtype == torch.float32:
        return a.shape == b.shape and bool(((a - b).abs().max() <= 1e-5 * b.abs().max()).item() if a.numel() else True)
    return torch.equal(a, b)


@pytest.mark.parametrize("kind,dtype", KINDS)
@pytest.mark.parametrize("shape", [(1, 48), (32, 48), (0, 1, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear(kind, dtype, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        assert same(PackedLinear(linear, kind)(x), linear(x), kind)
        # not contiguous: F.linear itself rounds a strided input with a bias differently (by one bf16 step);
        # the packed layer gives what F.linear gives for the same values laid out contiguously
        strided = torch.randn(4, 48, 3, dtype=dtype).transpose(1, 2)
        assert same(PackedLinear(linear, kind)(strided), linear(strided.contiguous()), kind)


@mkl
def test_one_mkl_packed_copy_serves_every_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = PackedLinear(linear, MKL)
    with torch.inference_mode():
        for rows in range(1, 41):  # F.linear's own path below MKL_MIN_ROWS, the packed copy from there
            x = torch.randn(rows, 1, 64)
            assert same(layer(x), linear(x), MKL), rows
        # the plain weight that the products of few rows read, zeroed: from MKL_MIN_ROWS the packed copy answers
        layer.product.weight = torch.zeros_like(linear.weight)
        x = torch.randn(40, 64)
        assert torch.equal(layer(x[: MKL_MIN_ROWS - 1]), linear.bias.detach().expand(MKL_MIN_ROWS - 1, 96))
        assert same(layer(x[:MKL_MIN_ROWS]), linear(x[:MKL_MIN_ROWS]), MKL)
    assert layer.product.added > 0


@mkl
def test_mkl_packs_only_what_takes_under_a_quarter_of_the_free_memory():
    model = tiny_llama(tied=True).float()
    assert mkl_fits(model, free_bytes=1 << 40) == (True, "")
    fits, why = mkl_fits(model, free_bytes=1 << 20)
    assert not fits and why.startswith("MKL's packed weights would take") and "over a quarter of 0.0 GB" in why


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("kind,dtype", KINDS)
@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_gives_the_same_logits_and_counts_what_it_holds_twice(kind, dtype, tied):
    model = tiny_llama(tied).to(dtype)
    plain = copy.deepcopy(model)
    packed, added = pack_linears(model, kind)
    assert packed == 2 * 7 + 1  # q k v o gate up down per layer, and the output layer
    if kind == ONEDNN:
        assert added == (96 * 64 * dtype.itemsize if tied else 0)  # a tied output layer's weight stays in the embedding
    else:
        assert added == sum(m.product.added for m in model.modules() if isinstance(m, PackedLinear)) > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert same(model(ids).logits, plain(ids).logits, kind)


@pytest.mark.parametrize("kind,dtype", KINDS)
def test_lora_adapters_keep_their_own_matrices_and_answer_as_before_when_their_base_is_packed(kind, dtype):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(tied=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora, adapter_name="a")
    torch.manual_seed(2)
    model.add_adapter("b", lora)
    model = model.to(dtype).eval()
    plain = copy.deepcopy(model)
    packed, _ = pack_linears(model, kind)
    assert packed == 2 * 7 + 1
    lora_layers = [m for n, m in model.named_modules() if "lora_A" in n or "lora_B" in n]
    assert lora_layers and all(type(m) is not PackedLinear for m in lora_layers)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3)).repeat(3, 1)  # one prompt
    names = ["a", "b", "__base__"]  # one adapter per row, as the engine batches them
    with torch.inference_mode():
        out = model(input_ids=ids, adapter_names=names).logits
        assert same(out, plain(input_ids=ids, adapter_names=names).logits, kind)
        assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])  # the adapters matter


def test_nothing_is_packed_where_no_library_packs_it():
    assert packing("meta", torch.bfloat16) is None
    assert packing("cpu", torch.float16) is None


@onednn32
def test_fp32_is_packed_for_onednn_where_it_can_and_for_mkl_where_only_mkl_is_there(monkeypatch):
    from gpuwise.serve.engines.gpuwise import packed

    assert packing("cpu", torch.float32) == ONEDNN
    monkeypatch.setattr(packed, "onednn_packs", lambda dtype: False)
    assert packing("cpu", torch.float32) == (MKL if mkl_packs() else None)
    assert packing("cpu", torch.bfloat16) is None
