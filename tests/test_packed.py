"""Linears packed once (serve/packed.py), bf16 for oneDNN and fp32 for MKL, compute bitwise what `F.linear`
computes: alone (MKL at every row count from 1 to 40, one packed copy for all), in a tiny Llama with a tied
output layer, and under two LoRA adapters in one mixed batch; what is packed and what it adds is counted,
and MKL's copies are packed only where they fit."""

import copy

import pytest
import torch
from torch import nn

from gpuwise.serve.packed import MKL, MKL_MIN_ROWS, ONEDNN, PackedLinear, mkl_fits, pack_linears, packing

onednn = pytest.mark.skipif(
    packing("cpu", torch.bfloat16) != ONEDNN, reason="this PyTorch build has no oneDNN bf16 linear on this CPU"
)
mkl = pytest.mark.skipif(packing("cpu", torch.float32) != MKL, reason="this PyTorch build has no MKL packed GEMM")
DTYPE = {ONEDNN: torch.bfloat16, MKL: torch.float32}
KINDS = [pytest.param(ONEDNN, marks=onednn), pytest.param(MKL, marks=mkl)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 48), (32, 48), (0, 1, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear_bitwise(kind, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias).to(DTYPE[kind])
    x = torch.randn(shape, dtype=DTYPE[kind])
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear, kind)(x), linear(x))
        # not contiguous: F.linear itself rounds a strided input with a bias differently (by one bf16 step);
        # the packed layer gives what F.linear gives for the same values laid out contiguously
        strided = torch.randn(4, 48, 3, dtype=DTYPE[kind]).transpose(1, 2)
        assert torch.equal(PackedLinear(linear, kind)(strided), linear(strided.contiguous()))


@mkl
def test_one_mkl_packed_copy_serves_every_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = PackedLinear(linear, MKL)
    with torch.inference_mode():
        for rows in range(1, 41):  # F.linear's own path below MKL_MIN_ROWS, the packed copy from there
            x = torch.randn(rows, 1, 64)
            assert torch.equal(layer(x), linear(x)), rows
        # the plain weight that the products of few rows read, zeroed: from MKL_MIN_ROWS the packed copy answers
        layer.product.weight = torch.zeros_like(linear.weight)
        x = torch.randn(40, 64)
        assert torch.equal(layer(x[: MKL_MIN_ROWS - 1]), linear.bias.detach().expand(MKL_MIN_ROWS - 1, 96))
        assert torch.equal(layer(x[:MKL_MIN_ROWS]), linear(x[:MKL_MIN_ROWS]))
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_gives_the_same_logits_and_counts_what_it_holds_twice(kind, tied):
    model = tiny_llama(tied).to(DTYPE[kind])
    plain = copy.deepcopy(model)
    packed, added = pack_linears(model, kind)
    assert packed == 2 * 7 + 1  # q k v o gate up down per layer, and the output layer
    if kind == ONEDNN:
        assert added == (96 * 64 * 2 if tied else 0)  # a tied output layer's weight stays in the embedding
    else:
        assert added == sum(m.product.added for m in model.modules() if isinstance(m, PackedLinear)) > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_adapters_keep_their_own_matrices_and_answer_as_before_when_their_base_is_packed(kind):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(tied=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora, adapter_name="a")
    torch.manual_seed(2)
    model.add_adapter("b", lora)
    model = model.to(DTYPE[kind]).eval()
    plain = copy.deepcopy(model)
    packed, _ = pack_linears(model, kind)
    assert packed == 2 * 7 + 1
    lora_layers = [m for n, m in model.named_modules() if "lora_A" in n or "lora_B" in n]
    assert lora_layers and all(type(m) is not PackedLinear for m in lora_layers)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3)).repeat(3, 1)  # one prompt
    names = ["a", "b", "__base__"]  # one adapter per row, as the engine batches them
    with torch.inference_mode():
        out = model(input_ids=ids, adapter_names=names).logits
        assert torch.equal(out, plain(input_ids=ids, adapter_names=names).logits)
        assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])  # the adapters matter


def test_nothing_is_packed_where_no_library_packs_it():
    assert packing("meta", torch.bfloat16) is None
    assert packing("cpu", torch.float16) is None
