"""What `gpuwise serve` holds in memory, against what it says it holds: its weights (the start-up line's held
bytes, measured by the decoder), the KV blocks in use (its /metrics), and the runtime's base, for bf16, int8 and
int4 weights of SmolLM2-135M-Instruct, under one 6,000-token prompt among 31 short chats (issue #54).

Run: .venv/bin/python benchmarks/serve_memory.py [--weights bf16,int8,int4] [--long 6000] [--short 31]

The runtime's base is the same server (same flags, engine, kernels and tokenizer) on a Llama of the same vocabulary
with one layer of width 64, whose weights are 1/4,000 of SmolLM2's: its resident memory after the same requests.
Each server then takes the long prompt and the short chats at once (max_tokens 16); /metrics' KV positions held
are sampled every 20 ms and the most is kept. Its resident memory (VmRSS, /proc) after the load is set beside
base + weights held + that KV (at the engine's bytes per token). A row per sequence as long as the longest,
the cache before issue #54, would have held 32 x the longest prompt: printed beside.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import threading
import time
from pathlib import Path

import httpx
from llm_serve_load import BASE, PROMPTS, start


def rss(pid: int) -> int:
    """Resident bytes of a process (VmRSS)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def metric(url: str, name: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))  # fmt: skip


def long_prompt(tok, tokens: int) -> str:
    """A text of about `tokens` tokens (varied, so that nothing in it repeats exactly)."""
    words = ["coffee", "tea", "roast", "bean", "grinder", "kettle", "cup", "morning", "bitter", "sweet", "review"]
    parts, n, i = [], 0, 0
    while n < tokens - 40:
        piece = f" Note {i}: the {words[i % 11]} and the {words[(i * 7) % 11]} were {words[(i * 3) % 11]}."
        parts.append(piece)
        n += len(tok(piece)["input_ids"])
        i += 1
    return "Summarize these notes in one line." + "".join(parts)


async def load(url: str, model: str, prompts: list[str]) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=1200)
    async with client:
        await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
                )
                for p in prompts
            )
        )


def serve_and_load(model_dir: str, weights: str, prompts: list[str], log: Path) -> dict:
    kind = "gpuwise" if weights == "bf16" else f"gpuwise-{weights}"
    extra = ("--max-model-len", "8192", "--prefix-cache", "0", "--max-prompt-chars", "100000")
    proc, url, model = start(kind, model_dir, "bf16", log, extra=extra)
    try:
        text = log.read_text()
        held = re.search(r"held:\s+([0-9.]+)\s+GB", text)  # the console may fold the line anywhere
        per_token = re.search(r"KV\s+cache\s+([0-9.]+)\s+KiB\s+per\s+token", text)
        idle = rss(proc.pid)
        peak, done = 0.0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, metric(url, "gpuwise_kv_cache_held_tokens"))
                time.sleep(0.02)

        watcher = threading.Thread(target=sample)
        watcher.start()
        t0 = time.perf_counter()
        try:
            asyncio.run(load(url, model, prompts))
        finally:
            done.set()
            watcher.join()
        return {
            "seconds": time.perf_counter() - t0,
            "rss": rss(proc.pid),
            "idle": idle,
            "held": float(held.group(1)) * 1e9 if held else float("nan"),
            "kv_tokens": peak,
            "kv_per_token": float(per_token.group(1)) * 1024 if per_token else float("nan"),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def tiny_model(model_dir: str, out: Path) -> str:
    """A Llama of SmolLM2's vocabulary and tokenizer, one layer of width 64: the runtime with next to no weights."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    own = AutoConfig.from_pretrained(model_dir)
    config = LlamaConfig(vocab_size=own.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=own.bos_token_id,
                         eos_token_id=own.eos_token_id)  # fmt: skip
    LlamaForCausalLM(config).to("cpu").save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,int8,int4")
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--short", type=int, default=31)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from gpuwise.workloads.pretrained import resolve_base

    model_dir = str(resolve_base(BASE))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [long_prompt(tok, args.long)] + [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.short)]
    longest = len(tok(prompts[0])["input_ids"])
    work = Path(tempfile.mkdtemp(prefix="serve-memory-"))
    base = serve_and_load(tiny_model(model_dir, work / "tiny"), "bf16", prompts, work / "tiny.log")
    base_rss = base["rss"] - base["held"] - base["kv_tokens"] * base["kv_per_token"]
    print(f"SmolLM2-135M-Instruct, one prompt of {longest:,} tokens among {args.short} short chats (max_tokens 16), "
          f"--max-seqs 32; runtime base {base_rss / 1e9:.3f} GB (a 1-layer model of width 64, same server, same "
          f"load: its VmRSS {base['rss'] / 1e9:.3f} GB less its weights and KV)")  # fmt: skip
    head = f"{'weights':<8}{'held GB':>9}{'KV peak':>9}{'KV GB':>8}{'expected':>10}{'idle':>8}{'VmRSS':>8}"
    head += f"{'RSS/exp':>9}"
    print(f"{head}{'a row each':>12}{'load s':>8}")
    for weights in args.weights.split(","):
        r = serve_and_load(model_dir, weights, prompts, work / f"{weights}.log")
        kv = r["kv_tokens"] * r["kv_per_token"]
        expected = base_rss + r["held"] + kv
        rows = 32 * longest * r["kv_per_token"]
        print(f"{weights:<8}{r['held'] / 1e9:>9.3f}{int(r['kv_tokens']):>9,}{kv / 1e9:>8.3f}{expected / 1e9:>10.3f}"
              f"{r['idle'] / 1e9:>8.3f}{r['rss'] / 1e9:>8.3f}{r['rss'] / expected:>8.2f}x{rows / 1e9:>11.2f}G"
              f"{r['seconds']:>8.1f}")  # fmt: skip
    print("expected = base + held + KV peak; idle: VmRSS once started, before the load; 'a row each': the KV of 32 "
          "rows of the longest prompt (the cache before)")


if __name__ == "__main__":
    main()
