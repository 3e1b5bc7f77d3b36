"""Issue #48: one call plans an LLM server (plan/serving.py `plan_server`: context, KV bytes per token, KV budget,
slots), and gpuwise's engine, vLLM and llama.cpp read that one plan; one KV formula, which `gpuwise plan` counts
too."""

from pathlib import Path

import pytest
from serving import tiny_chat_model

from gpuwise.plan.memory import kv_bytes_per_token, kv_cache_bytes
from gpuwise.plan.model import resolve_model
from gpuwise.plan.request import Layout, PlanRequest
from gpuwise.plan.serving import KV_SHARE, plan_server
from gpuwise.workloads.serving import Limits

GIB = 2**30


class Config:
    """The fields of a transformers config the plan reads."""

    def __init__(self, layers=32, heads=32, kv_heads=8, hidden=4096, context=131072, head_dim=None):
        self.num_hidden_layers, self.num_attention_heads, self.num_key_value_heads = layers, heads, kv_heads
        self.hidden_size, self.max_position_embeddings = hidden, context
        if head_dim:
            self.head_dim = head_dim


def test_the_kv_formula_gives_the_published_figure_for_llama_3_8b():
    # Llama 3 8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB a token in 16 bits (as vLLM's
    # and NVIDIA's sizing guides state it)
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024
    assert plan_server(Config(), 2, max_seqs=1).kv_bytes_per_token == 128 * 1024
    # `gpuwise plan` counts the same per token, and splits the KV heads over tensor-parallel GPUs
    spec = resolve_model("llama-3.1-8b")
    one = PlanRequest(task="inference", batch=1, seq=1, gen=0, precision="bf16")
    assert kv_cache_bytes(spec, one, Layout()) == 128 * 1024
    assert kv_cache_bytes(spec, one, Layout(tp=2)) == 64 * 1024
    assert kv_cache_bytes(spec, one, Layout(tp=16)) == 16 * 1024  # 8 heads over 16 GPUs: one each, replicated


def test_the_budget_is_what_memory_holds_between_one_full_context_and_every_slot_at_it():
    per_token = 128 * 1024
    free = 64 * GIB
    plan = plan_server(Config(), 2, max_seqs=32, max_model_len=8192, free_bytes=free, device="cuda")
    assert plan.context == 8192 and plan.slots == 32
    assert plan.kv_budget == min(32 * 8192, int(free * KV_SHARE["cuda"]) // per_token)
    assert "90% of the 64.0 GiB free on the cuda" == plan.source
    tight = plan_server(Config(), 2, max_seqs=32, free_bytes=1 * GIB, device="cpu")
    assert tight.kv_budget == tight.context == 131072  # one sequence at the full context at least
    roomy = plan_server(Config(), 2, max_seqs=4, max_model_len=1024, free_bytes=1024 * GIB, device="cpu")
    assert roomy.kv_budget == 4 * 1024 and roomy.at_full_context == 4  # every slot at the full context at most
    unsized = plan_server(Config(), 2, max_seqs=8, max_model_len=2048)
    assert unsized.kv_budget == 8 * 2048 and unsized.source == "every slot at the full context"
    assert plan_server(Config(context=4096), 2, max_seqs=1, max_model_len=8192).context == 4096  # the model's own


def test_a_prefix_cache_of_its_own_comes_out_of_the_budget():
    args = {"value_bytes": 2, "max_seqs": 64, "max_model_len": 4096, "free_bytes": 8 * GIB, "device": "cpu"}
    shared = plan_server(Config(), prefix_tokens=4096, **args)
    own = plan_server(Config(), prefix_tokens=4096, separate_prefix=True, **args)
    assert shared.prefix_tokens == 0 and own.prefix_tokens == 4096
    assert shared.kv_budget - own.kv_budget == 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("plan") / "tiny")


def test_the_three_engines_read_one_serving_plan(tiny, monkeypatch):
    """Each engine's backend, built as `gpuwise serve` builds it (the child engines not started), holds the plan
    `plan_server` made, and sets its knobs from it: gpuwise's engine its cache and admission, vLLM its
    --max-model-len, --max-num-seqs and VLLM_CPU_KVCACHE_SPACE, llama.cpp its --ctx-size and --parallel."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gpuwise.plan import serving
    from gpuwise.plan.engines import cpu_kv_gib
    from gpuwise.serve.engines import llamacpp, vllm
    from gpuwise.serve.engines.gpuwise import backend as own

    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return serving.plan_server(*args, **kwargs)

    for module in (own, vllm, llamacpp):
        monkeypatch.setattr(module, "plan_server", spy)
        monkeypatch.setattr(module, "free_memory", lambda device: 3 * GIB)  # the same memory seen by all three
    monkeypatch.setattr(llamacpp, "gguf_model", lambda *a: (Path("tiny.gguf"), "not converted: this test's"))
    limits = Limits(max_seqs=3, max_model_len=100, prefix_cache_tokens=0)  # no prefix cache of its own: one plan
    tok, config = AutoTokenizer.from_pretrained(tiny), AutoConfig.from_pretrained(tiny)

    gpuwise = own.GpuwiseBackend(AutoModelForCausalLM.from_pretrained(tiny), tok, limits, "fp32", "cpu")
    try:
        on_vllm = vllm.VLLMBackend(str(tiny), tok, config, [("tiny", None)], limits, "fp32", "cpu")
        on_llama = llamacpp.LlamaCppBackend(str(tiny), str(tiny), tok, config, [("tiny", None)], limits, "fp32",
                                            Path("llama-server"))  # fmt: skip
        on_vllm.cleanup()
        assert len(calls) == 3
        plan = gpuwise.serving
        assert plan == on_vllm.serving == on_llama.serving
        assert plan.context == 100 and plan.slots == 3 and plan.kv_bytes_per_token == 2 * 2 * 1 * 16 * 4
        engine = gpuwise.engine
        assert (engine.context, engine.max_seqs, engine.kv_budget) == (plan.context, plan.slots, plan.kv_budget)
        assert engine.cache.bytes_per_token() == plan.kv_bytes_per_token  # the cache it allocates, by the formula
        args = on_vllm.args
        assert (args.max_model_len, args.max_num_seqs) == (plan.context, plan.slots)
        assert args.kv_cache_gib == cpu_kv_gib(plan.kv_budget, plan.kv_bytes_per_token)
        assert (on_llama.args.ctx_size, on_llama.args.parallel) == (plan.kv_budget, plan.slots)
    finally:
        gpuwise.close()


def test_a_cpu_engine_leaves_one_core_to_the_front_end_unless_told():
    from gpuwise.plan.serving import compute_threads

    said = "15 compute threads of 16 cores (one left to the front end; --threads to change)"
    assert compute_threads(16) == (15, said)
    assert compute_threads(2)[0] == 1
    assert compute_threads(1) == (1, "1 compute thread of 1 core (the front end shares it; --threads to change)")
    # llama.cpp, a process of its own, takes every core: one fewer cost it half its capacity on 2 cores
    assert compute_threads(2, "llama.cpp") == (2, "2 compute threads of 2 cores (--threads to change)")
    assert compute_threads(16, given=16) == (16, "16 compute threads (--threads)")
    assert compute_threads(16, given=4, env="8")[0] == 4  # the flag over the environment
    assert compute_threads(16, "llama.cpp", env="8") == (8, "8 compute threads (OMP_NUM_THREADS)")
    assert compute_threads(16, env="many")[0] == 15 and compute_threads(16, env="0")[0] == 15
