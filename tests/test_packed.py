"""bf16 linears prepacked for oneDNN (serve/packed.py) compute bitwise what `F.linear` computes: alone, in a
tiny Llama with a tied output layer, and under two LoRA adapters in one mixed batch; what is packed and what
is held twice is counted."""

import copy

import pytest
import torch
from torch import nn

from gpuwise.serve.packed import PackedLinear, pack_linears, packable

pytestmark = pytest.mark.skipif(
    not packable("cpu", torch.bfloat16), reason="this PyTorch build has no oneDNN bf16 linear on this CPU"
)


@pytest.mark.parametrize("shape", [(1, 48), (32, 48), (0, 1, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear_bitwise(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(PackedLinear(linear)(x), linear(x))
        # not contiguous: F.linear itself rounds a strided input with a bias differently (by one bf16 step);
        # the packed layer gives what F.linear gives for the same values laid out contiguously
        strided = torch.randn(4, 48, 3, dtype=torch.bfloat16).transpose(1, 2)
        assert torch.equal(PackedLinear(linear)(strided), linear(strided.contiguous()))


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_a_packed_model_gives_the_same_logits_and_counts_what_it_holds_twice(tied):
    model = tiny_llama(tied)
    plain = copy.deepcopy(model)
    packed, added = pack_linears(model)
    assert packed == 2 * 7 + 1  # q k v o gate up down per layer, and the output layer
    assert added == (96 * 64 * 2 if tied else 0)  # a tied output layer's weight stays in the embedding
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_lora_adapters_keep_their_own_matrices_and_answer_as_before_when_their_base_is_packed():
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(tied=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora, adapter_name="a")
    torch.manual_seed(2)
    model.add_adapter("b", lora)
    model = model.to(torch.bfloat16).eval()
    plain = copy.deepcopy(model)
    packed, _ = pack_linears(model)
    assert packed == 2 * 7 + 1
    lora_layers = [m for n, m in model.named_modules() if "lora_A" in n or "lora_B" in n]
    assert lora_layers and all(type(m) is not PackedLinear for m in lora_layers)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3)).repeat(3, 1)  # one prompt
    names = ["a", "b", "__base__"]  # one adapter per row, as the engine batches them
    with torch.inference_mode():
        out = model(input_ids=ids, adapter_names=names).logits
        assert torch.equal(out, plain(input_ids=ids, adapter_names=names).logits)
        assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])  # the adapters matter


def test_nothing_is_packed_where_it_would_not_help():
    assert not packable("cpu", torch.float32)  # fp32 linears gained little and rounded differently
    assert not packable("meta", torch.bfloat16)
