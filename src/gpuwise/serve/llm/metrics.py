"""vLLM's serving series, under gpuwise_ names, in the server's Prometheus registry: the same for every
engine, fed by each engine's `EngineStats` callbacks."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from gpuwise.serve.engines.base import Backend, Sequence
from gpuwise.serve.llm.session import Session

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def register(backends: list[Backend], registry: Any, session: Session | None = None) -> None:
    """The series of a server over `backends`, and each engine's stats wired to them (and to `session`, which
    keeps each finished request for the record)."""
    stats = [b.engine.stats for b in backends]
    ttft = Histogram(
        "gpuwise_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=registry
    )
    itl = Histogram(
        "gpuwise_inter_token_latency_seconds",
        "Time between two tokens of one stream",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    # per request, as vLLM's vllm:request_time_per_output_token_seconds: what a TPOT target is stated on
    tpot = Histogram(
        "gpuwise_request_time_per_output_token_seconds",
        "A request's time per output token after the first",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    e2e = Histogram(
        "gpuwise_e2e_request_latency_seconds",
        "Request submitted to last token",
        buckets=LATENCY_BUCKETS,
        registry=registry,
    )
    prompt = Counter("gpuwise_prompt_tokens", "Prompt tokens processed", registry=registry)
    # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: hits / queries is the share not recomputed
    queries = Counter("gpuwise_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=registry)
    hits = Counter("gpuwise_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=registry)
    generated = Counter("gpuwise_generation_tokens", "Tokens generated", registry=registry)
    Gauge("gpuwise_num_requests_running", "Sequences in the running batch", registry=registry).set_function(
        lambda: sum(s.running for s in stats)
    )
    Gauge("gpuwise_num_requests_waiting", "Requests waiting for a slot", registry=registry).set_function(
        lambda: sum(s.waiting for s in stats)
    )
    budget = sum(b.serving.kv_budget for b in backends)
    Gauge(
        "gpuwise_kv_cache_usage_perc", "Share of the KV budget the running sequences reserve", registry=registry
    ).set_function(lambda: sum(s.kv_tokens for s in stats) / budget)
    Gauge(
        "gpuwise_kv_cache_held_tokens",
        "Positions the KV blocks held have room for (gpuwise's paged cache, its prefix cache included)",
        registry=registry,
    ).set_function(lambda: sum(s.kv_held for s in stats))

    def finished(seq: Sequence) -> None:
        e2e.observe(time.perf_counter() - seq.t_submit)
        if seq.finish in ("stop", "length") and (per_token := seq.tpot) is not None:
            tpot.observe(per_token)
        if session is not None:
            session.finished(seq)
        prompt.inc(len(seq.prompt))
        generated.inc(len(seq.out))

    def prefilled(prompt_tokens: int, reused: int) -> None:
        queries.inc(prompt_tokens)
        hits.inc(reused)

    for s in stats:
        s.on_first_token, s.on_token, s.on_finish, s.on_prefill = ttft.observe, itl.observe, finished, prefilled
