"""The plan of an LLM server, one for every engine: the context a sequence may take, the bytes one token's keys
and values take, the KV budget (tokens the running sequences may hold) and the slots (sequences at once).

gpuwise's engine sizes its cache and admits by it; vLLM is given its `--max-model-len`, `--max-num-seqs` and, on
a CPU, `VLLM_CPU_KVCACHE_SPACE` from it; llama.cpp its `--ctx-size` and `--parallel`. One call makes it
(`plan_server`), so the three engines cannot disagree on what the same model and limits allow."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwise.plan.memory import kv_bytes_per_token

# Memory the KV cache may take of what is free: on CUDA all but a tenth (vLLM's own gpu_memory_utilization
# default, plan/engines.py); on a CPU half of what the system has available (the rest is for activations, the
# tokenizer and the OS).
KV_SHARE = {"cuda": 0.9, "cpu": 0.5}

# Tokens a block of gpuwise's paged KV cache holds (vLLM's default on a GPU): a sequence holds its tokens rounded
# up to a block, 7.5 tokens a sequence wasted on average; smaller blocks cost more block-table reads a step.
KV_BLOCK = 16


@dataclass(frozen=True)
class ServingPlan:
    """What every engine reads. `kv_budget` is in tokens; `prefix_tokens` is the prompt tokens a prefix cache
    of its own keeps (gpuwise's engine; vLLM and llama.cpp reuse blocks of the budget instead)."""

    context: int
    kv_bytes_per_token: int
    kv_budget: int
    slots: int
    prefix_tokens: int
    source: str  # where the budget came from: the memory measured, or slots x context

    @property
    def kv_blocks(self) -> int:
        """The budget in blocks of KV_BLOCK tokens (gpuwise's paged cache)."""
        return -(-self.kv_budget // KV_BLOCK)

    @property
    def at_full_context(self) -> int:
        """Sequences the budget holds at the full context at once."""
        return self.kv_budget // self.context


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a transformers config."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


def model_context(config) -> int:
    """The context a transformers config declares (2,048 where it declares none)."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def plan_server(
    config,
    value_bytes: int,
    max_seqs: int,
    max_model_len: int = 0,
    prefix_tokens: int = 0,
    free_bytes: int | None = None,
    device: str = "cpu",
    separate_prefix: bool = False,
) -> ServingPlan:
    """The serving plan of a model (its transformers `config`) whose keys and values take `value_bytes` each.
    `max_model_len` (0: the model's own) bounds the context; `free_bytes`, the memory free on `device` (None:
    the engine sizes its own cache, as vLLM does on CUDA), bounds the budget at KV_SHARE of it, less a prefix
    cache of its own where the engine keeps one (`separate_prefix`). The budget holds one sequence at the full
    context at least, and every slot at the full context at most."""
    own = model_context(config)
    context = min(own, max_model_len) if max_model_len else own
    per_token = int(kv_bytes_per_token(*kv_shape(config), value_bytes))
    full = max_seqs * context
    kept = prefix_tokens if separate_prefix else 0
    if free_bytes is None:
        return ServingPlan(context, per_token, full, max_seqs, kept, "every slot at the full context")
    room = usable_bytes(free_bytes, device) - kept * per_token
    budget = max(context, min(full, room // max(1, per_token)))
    share = f"{KV_SHARE[device]:.0%} of the {free_bytes / 2**30:.1f} GiB free on the {device}"
    return ServingPlan(context, per_token, budget, max_seqs, kept, share)


def usable_bytes(free_bytes: int, device: str) -> int:
    """What of `free_bytes` a server may fill (its KV cache, packed weight copies): KV_SHARE of it."""
    return int(free_bytes * KV_SHARE[device])


# The threads of gpuwise's decode step of one row (one stream) where `gpuwise serve` keeps a core for its front
# end: every core (serve sets it; 0: as the compute threads). The front end's work a step is then one token, and
# on a 2-core Xeon such a step on both cores ran 1.6x as fast as on one (docs/serving.md, "Fewer bytes per token").
ONE_STREAM_THREADS = 0


def compute_threads(
    cores: int, engine: str = "gpuwise", given: int | None = None, env: str | None = None
) -> tuple[int, str]:
    """The compute threads of `engine` serving on a CPU of `cores`, and why: `given` (--threads), else the user's
    OMP_NUM_THREADS (`env`), else:
    - gpuwise's engine: all cores but one, which is left to the front end in the same process: its event loop
      reads each token and sends it on, and on every core those wake-ups preempt the engine's threads mid-step,
      so that steps under load ran slower than `bench --serve` measures them alone and the serving plan missed.
      With a core of its own, the plan holds, at the same capacity (vLLM-CPU reserves a core for its front end
      likewise: VLLM_CPU_NUM_OF_RESERVED_CPU);
    - llama.cpp, a process of its own whose threads each do a share of every step: every core, as llama.cpp
      itself would; one core fewer cost it more than half its capacity on 2 cores.
    docs/serving.md "One core for the front end" has the measurements."""

    def threads(n: int) -> str:
        return f"{n} compute thread{'s' if n > 1 else ''}"

    if given is not None:
        return given, f"{threads(given)} (--threads)"
    if env and env.isdigit() and int(env) > 0:
        return int(env), f"{threads(int(env))} (OMP_NUM_THREADS)"
    of = f"of {cores} core{'s' if cores > 1 else ''}"
    if engine == "llama.cpp":
        return cores, f"{threads(cores)} {of} (--threads to change)"
    n = max(1, cores - 1)
    left = "one left to the front end" if cores > 1 else "the front end shares it"
    return n, f"{threads(n)} {of} ({left}; --threads to change)"
