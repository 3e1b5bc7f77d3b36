"""An LLM engine's scheduler, simulated over a stream of requests: what latency each request sees.

The scheduler is vLLM's (V1, and Sarathi-Serve's chunked prefill, which vLLM adopted): each step
1. runs one decode token for every sequence whose prompt is in the cache,
2. spends what is left of a token budget per step (`max_num_batched_tokens`) on prompt chunks, first of the
   sequences already prefilling, then of waiting ones it admits in arrival order while the sequence limit
   (`max_num_seqs`) and the KV cache allow,
3. when a decode token finds the KV cache full, preempts the newest running sequence, which waits again at the
   head of the queue and recomputes its tokens (vLLM's recompute preemption).
A sequence's first token comes out of the step that finishes its prompt.

The time of a step comes from a `StepTime`: for a GPU the catalog's peaks with stated efficiencies (capacity.py),
for this machine's engines a fit of their measured steps (`gpuwise bench --serve`). Vidur (Agrawal et al., MLSys
2024) simulates the same scheduler from profiled operator times; this one prices a whole step, which is what a
step-level measurement of an engine we do not instrument (vLLM, llama.cpp) can give.

Why by hand: no maintained library simulates continuous batching at the step level (Vidur is a research
artifact pinned to its own profiles and CUDA). Decode-only stretches are advanced many steps at once, up to the
next arrival, finish or full cache, so a day's traffic runs in seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


class StepTime(Protocol):
    """Seconds one engine step takes: `tokens` computed (decode rows + prompt tokens), `kv_tokens` of context
    read from the KV cache, `pairs` of (query token, context token) the attention scores, and `outputs`: the
    sequences that sample a token (their logits and sampling, which a prompt's other tokens skip)."""

    def seconds(self, tokens: float, kv_tokens: float, pairs: float, outputs: float) -> float: ...

    def compute_bound(self, tokens: float, kv_tokens: float, pairs: float, outputs: float) -> bool: ...


@dataclass(frozen=True)
class Limits:
    """What one replica's scheduler may hold: sequences at once, tokens a step, and the KV cache in tokens.

    With `chunk_ratio`, prompt chunks are sized by time, as gpuwise's engine sizes them (its engine.py): about
    `chunk_ratio` decode steps while others decode, `solo_chunk_s` alone, at least `min_chunk` tokens a prompt,
    and never more than `token_budget` tokens."""

    max_seqs: int
    token_budget: int
    kv_tokens: int
    chunk_ratio: float = 0.0
    solo_chunk_s: float = 0.0
    min_chunk: int = 16


@dataclass(frozen=True)
class Request:
    arrive: float
    prompt: int
    output: int


def poisson(rate: float, n: int, prompt: int, output: int, seed: int = 0) -> list[Request]:
    """`n` requests arriving as a Poisson process of `rate` per second, each of the given lengths."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Request(t, prompt, output))
    return out


@dataclass
class _Seq:
    req: Request
    need: int  # tokens to put in the cache before the next token: the prompt (plus what it generated, if preempted)
    done: int = 0  # of `need`, in the cache
    gen: int = 0  # tokens generated
    first: float | None = None
    # while decoding: the step clock when it joined and `gen` then (gen = gen0 + clock - c0)
    c0: int = 0
    gen0: int = 0
    live: bool = False


@dataclass
class Outcome:
    """What a simulation measured: per request TTFT, TPOT (mean time per output token after the first) and the
    end-to-end time, and over the run the output throughput and what the scheduler ran into."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    compute_steps: int = 0  # steps whose time was compute, not memory, bound
    preemptions: int = 0
    kv_waits: int = 0  # steps where a waiting request stayed out for want of KV cache
    seq_waits: int = 0  # ... for want of a sequence slot
    peak_running: int = 0
    overloaded: bool = False  # the queue grew past any bound: the rate is beyond what the replica serves

    @property
    def throughput(self) -> float:
        """Output tokens per second over the run."""
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def attainment(self, ttft: float, tpot: float) -> float:
        """The share of requests that met both targets (DistServe's SLO attainment)."""
        if self.overloaded or not self.ttft:
            return 0.0
        met = sum(1 for a, b in zip(self.ttft, self.tpot, strict=True) if a <= ttft and b <= tpot)
        return met / len(self.ttft)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timed_budget(step: StepTime, limits: Limits, rows: int, ctx: float, prompts: int) -> int:
    """Prompt tokens a step may add when chunks are sized by time (Limits.chunk_ratio)."""
    base = step.seconds(rows, ctx, ctx, rows)
    per_token = max(1e-12, step.seconds(rows + 1, ctx + 1, ctx + 1, rows) - base)
    target = limits.chunk_ratio * base if rows else limits.solo_chunk_s
    return max(limits.min_chunk * max(1, prompts), int(target / per_token))


def simulate(
    step: StepTime,
    limits: Limits,
    requests: list[Request],
    warmup: float = 0.1,
    bounded: bool = True,
    request_s: float = 0.0,
) -> Outcome:
    """Run the scheduler over `requests` (sorted by arrival) to the last finish. The first `warmup` share of the
    requests fill the engine and are not measured. Stops early, `overloaded`, when the queue outgrows what the
    replica could ever catch up on (not when `bounded` is False: a burst sent at once). `request_s`: a request's
    time outside the engine's steps (HTTP, tokenizing), added to its TTFT."""
    out = Outcome()
    measured_from = int(len(requests) * warmup)
    index = {id(r): i for i, r in enumerate(requests)}
    waiting: deque[_Seq] = deque()
    prefilling: list[_Seq] = []
    decoding: list[_Seq] = []  # in join order: the newest is preempted first
    finishes: list[tuple[int, int, _Seq]] = []  # (clock at which it has all its tokens, tiebreak, seq)
    clock = 0  # decode steps so far
    ctx_base = 0  # sum over decoding seqs of (need + gen0 - c0): their context is ctx_base + len * clock
    t = 0.0
    nxt = 0
    queue_bound = 4 * limits.max_seqs + 1000
    order = itertools.count()  # the heap's tiebreak: join order, so that a run repeats exactly

    def finish(s: _Seq) -> None:
        out.output_tokens += s.req.output
        i = index[id(s.req)]
        if i >= measured_from:
            first = s.first if s.first is not None else t
            out.ttft.append(first - s.req.arrive + request_s)
            out.tpot.append((t - first) / (s.req.output - 1) if s.req.output > 1 else 0.0)
            out.e2e.append(t - s.req.arrive + request_s)

    def join(s: _Seq) -> None:
        nonlocal ctx_base
        s.c0, s.gen0, s.live = clock, s.gen, True
        decoding.append(s)
        ctx_base += s.need + s.gen0 - s.c0
        heapq.heappush(finishes, (clock + s.req.output - s.gen, next(order), s))

    def leave(s: _Seq) -> None:
        nonlocal ctx_base
        s.gen = s.gen0 + clock - s.c0
        ctx_base -= s.need + s.gen0 - s.c0
        s.live = False
        decoding.remove(s)

    while True:
        while nxt < len(requests) and requests[nxt].arrive <= t:
            waiting.append(_Seq(requests[nxt], requests[nxt].prompt))
            nxt += 1
        if not waiting and not prefilling and not decoding:
            if nxt == len(requests):
                break
            t = requests[nxt].arrive
            continue
        if bounded and len(waiting) > queue_bound:
            out.overloaded = True
            break
        n = len(decoding)
        out.peak_running = max(out.peak_running, n + len(prefilling))
        ctx = ctx_base + n * clock  # the decoding sequences' tokens in the cache
        used = ctx + sum(s.done for s in prefilling)
        preempted = False
        while n and used + n > limits.kv_tokens:  # no room for this step's tokens: preempt the newest
            if prefilling:
                s = prefilling.pop()
                used -= s.done
            else:
                s = decoding[-1]
                leave(s)
                n -= 1
                ctx = ctx_base + n * clock
                used = ctx + sum(p.done for p in prefilling)
            s.need, s.done = s.req.prompt + s.gen, 0
            waiting.appendleft(s)
            out.preemptions += 1
            preempted = True

        # prompt chunks this step: those prefilling first, then newcomers while the limits allow
        budget = limits.token_budget - n
        if limits.chunk_ratio:
            budget = min(budget, timed_budget(step, limits, n, ctx, len(prefilling) + bool(waiting)))
        chunks: list[tuple[_Seq, int]] = []
        room = limits.kv_tokens - used - n
        for s in prefilling:
            if budget <= 0 or room <= 0:
                break
            c = min(budget, s.need - s.done, room)
            chunks.append((s, c))
            budget, room = budget - c, room - c
        while waiting and budget > 0 and not preempted:  # vLLM admits no one in a step that preempted
            if n + len(prefilling) >= limits.max_seqs:
                out.seq_waits += 1
                break
            s = waiting[0]
            c = min(budget, s.need - s.done)
            if c > room and (n or prefilling):
                out.kv_waits += 1
                break  # it waits for room; alone it runs (the plan refused requests longer than the cache)
            waiting.popleft()
            prefilling.append(s)
            chunks.append((s, c))
            budget, room = budget - c, room - c

        if not chunks:  # decode only: run up to the next event in one go
            k = finishes[0][0] - clock if finishes else 1
            k = min(k, max(1, (limits.kv_tokens - used) // max(1, n)))
            mid = ctx + n * (k - 1) / 2
            dt = step.seconds(n, mid, mid, n)
            if not waiting and nxt < len(requests):  # a newcomer would start prefilling: stop at its arrival
                k = min(k, max(1, math.ceil((requests[nxt].arrive - t) / dt)))
                mid = ctx + n * (k - 1) / 2
                dt = step.seconds(n, mid, mid, n)
            t += k * dt
            clock += k
            out.steps += k
            out.compute_steps += k if step.compute_bound(n, mid, mid, n) else 0
        else:
            tokens = n + sum(c for _, c in chunks)
            kv = ctx + sum(s.done + c for s, c in chunks)
            pairs = ctx + sum(c * (s.done + c / 2) for s, c in chunks)
            outputs = n + sum(1 for s, c in chunks if s.done + c == s.need)  # decode rows and prompts finished
            t += step.seconds(tokens, kv, pairs, outputs)
            out.steps += 1
            out.compute_steps += 1 if step.compute_bound(tokens, kv, pairs, outputs) else 0
            if n:
                clock += 1
            for s, c in chunks:
                s.done += c
                if s.done == s.need:  # its prompt is in: this step gave its next token
                    prefilling.remove(s)
                    s.gen += 1
                    if s.first is None:
                        s.first = t
                    if s.gen >= s.req.output:
                        finish(s)
                    else:
                        join(s)
        while finishes and finishes[0][0] <= clock:
            _, _, s = heapq.heappop(finishes)
            if s.live and s.gen0 + clock - s.c0 >= s.req.output:
                leave(s)
                finish(s)
            elif s.live:  # a stale entry of a sequence preempted and rejoined: its own entry is later
                continue
    out.seconds = t
    return out
