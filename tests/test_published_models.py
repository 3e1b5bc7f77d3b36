"""Golden numbers: every preset against the parameter count its model card or paper publishes (plan/presets.py)."""

import json

import pytest

from gpuwise.plan.model import resolve_model
from gpuwise.plan.presets import PRESETS

MiB = 2**20


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_published(name):
    # Published counts are rounded to 3 significant figures (0.49 B, 13.0 B): 1 % covers the rounding.
    model = resolve_model(name)
    assert model.params == pytest.approx(model.published_params, rel=0.01)


def test_published_table_dimensions_reproduced():
    # Llama 2 uses a gated MLP, 3 matrices of hidden x ffn per layer: llama-2-7b counted by hand.
    m = resolve_model("llama-2-7b")
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert m.params == 32 * per_layer + 2 * 32000 * 4096 + 4096


def test_kv_cache_per_token_llama2_7b_is_half_a_mib():
    # 2 (K and V) x 32 layers x 4096 x 2 bytes = 0.5 MiB per token (exact).
    assert resolve_model("llama-2-7b").kv_cache_per_token(2) == 0.5 * MiB


def test_kv_cache_is_gqa_aware():
    # Llama 3.1 8B has 8 KV heads of 32: a quarter of the MHA cache, 128 KiB per fp16 token (exact).
    assert resolve_model("llama-3.1-8b").kv_cache_per_token(2) == 128 * 1024


def test_bert_base_cased_weights_match_accelerate_estimate(tmp_path):
    # Hugging Face accelerate estimate-memory, bert-base-cased fp32 load: 413.18 "MB" (MiB as it prints).
    # Tolerance 0.05 %: the figure is printed with 2 decimals.
    cfg = {
        "model_type": "bert",
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "vocab_size": 28996,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = resolve_model(str(tmp_path))
    assert model.params * 4 / MiB == pytest.approx(413.18, rel=5e-4)


def test_hf_config_of_a_llama_equals_its_preset(tmp_path):
    cfg = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_model(str(path)).params == resolve_model("llama-3.1-8b").params


def test_hf_config_qwen2_tied_with_qkv_bias(tmp_path):
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_model(str(path)).params == resolve_model("qwen2.5-0.5b").params


def test_gpt2_family_counts_biases_and_positions(tmp_path):
    # GPT-2 small: 124,439,808 parameters (a count the GPT-2 architecture fixes exactly: tied head,
    # learned positions, LayerNorm and linear biases).
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_model(str(path)).params == 124_439_808


def test_explicit_dimensions_default_to_mha():
    m = resolve_model("layers=2,hidden=64,heads=4,ffn=128,vocab=100")
    assert (m.kv_heads, m.head_dim) == (4, 16)
    assert m.params == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 100 * 64 + 64
