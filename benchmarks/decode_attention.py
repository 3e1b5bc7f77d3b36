"""Decode attention, one layer's call, side by side: gpuwise's CPU kernel (serve/engines/gpuwise/attention.py) against
PyTorch's
`scaled_dot_product_attention` as the fused decoder called it (grouped query heads folded, an additive mask), on
SmolLM2-135M's shapes (9 query heads, 3 key/value heads, head dim 64) over a row of keys per sequence; and the
kernel through block tables over the same keys in a paged cache (blocks of 16 tokens, each row's blocks spread
through the pool in a random order), as the engine now holds them: the cost of paging, side by side.

Run: .venv/bin/python benchmarks/decode_attention.py [--batches 1,8,32] [--lengths 64,128,512] [--rounds 5]

Each call reads one of 30 layers' caches in turn, as a decode step does, so that the keys and values come from
memory rather than from a cache the previous call warmed. Rounds alternate the order of the two; the figure is
the median over rounds of the mean time per call. Rows attend to lengths spread over [length/2, length].
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from gpuwise.serve.engines.gpuwise import attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
BLOCK = 16  # plan/serving.py KV_BLOCK


def case(kernel, dtype: torch.dtype, batch: int, length: int, rounds: int) -> tuple[float, float, float, float]:
    """(SDPA's microseconds per call, the kernel's on rows, through block tables, the kernel's largest difference
    from SDPA over its largest output) at one batch and length."""
    shape = (LAYERS, batch, 2 * length, KV_HEADS, HEAD_DIM)
    keys, values = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    lens = torch.randint(length // 2, length + 1, (batch,))
    lens[0] = length
    allowed = torch.arange(length).view(1, length) < lens.view(batch, 1)
    bias = torch.zeros(batch, 1, 1, length, dtype=dtype)
    bias.masked_fill_(~allowed.view(batch, 1, 1, length), torch.finfo(dtype).min)
    fold = q.view(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    per = -(-length // BLOCK)
    table = torch.randperm(batch * per).view(batch, per).contiguous()  # row i's blocks, anywhere in the pool
    pool_k = torch.empty(LAYERS, batch * per, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    pool_v = torch.empty_like(pool_k)
    padded = (LAYERS, batch, per * BLOCK, KV_HEADS, HEAD_DIM)
    pool_k[:, table] = keys[:, :, : per * BLOCK].reshape(padded).view(LAYERS, batch, per, BLOCK, KV_HEADS, HEAD_DIM)
    pool_v[:, table] = values[:, :, : per * BLOCK].reshape(padded).view(LAYERS, batch, per, BLOCK, KV_HEADS, HEAD_DIM)

    def by_sdpa(i: int) -> torch.Tensor:
        k, v = keys[i, :, :length].transpose(1, 2), values[i, :, :length].transpose(1, 2)
        return F.scaled_dot_product_attention(fold, k, v, attn_mask=bias).reshape(batch, HEADS, HEAD_DIM)

    def by_kernel(i: int) -> torch.Tensor:
        return kernel(q, keys[i, :, :length], values[i, :, :length], lens)

    def by_table(i: int) -> torch.Tensor:
        return kernel(q, pool_k[i], pool_v[i], lens, table)

    ways = {"SDPA": by_sdpa, "kernel": by_kernel, "paged": by_table}
    times: dict[str, list[float]] = {w: [] for w in ways}
    with torch.inference_mode():
        ref = by_sdpa(0).float()
        diff = float((by_kernel(0).float() - ref).abs().max() / ref.abs().max())
        if not torch.equal(by_table(0), by_kernel(0)):
            raise SystemExit("the kernel through block tables is not the kernel on rows, bit for bit")
        for r in range(rounds):
            for w in ways if r % 2 == 0 else list(ways)[::-1]:
                for i in range(LAYERS):
                    ways[w](i)
                t = time.perf_counter()
                for _ in range(3):
                    for i in range(LAYERS):
                        ways[w](i)
                times[w].append((time.perf_counter() - t) / (3 * LAYERS) * 1e6)
    return statistics.median(times["SDPA"]), statistics.median(times["kernel"]), statistics.median(times["paged"]), diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="64,128,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    kernel, why = attention.load()
    if kernel is None:
        raise SystemExit(f"the kernel is not available here: {why}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(
        f"one decode-attention call, SmolLM2-135M's heads ({HEADS} query, {KV_HEADS} key/value, dim {HEAD_DIM}), "
        f"{LAYERS} layers' caches in turn; {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; median of {args.rounds} rounds, microseconds per call"
    )
    head = f"{'dtype':<6}{'batch':>6}{'length':>8}{'SDPA':>10}{'kernel':>10}{'speed-up':>10}{'paged':>10}"
    print(f"{head}{'paged/rows':>12}{'max diff':>11}")
    torch.manual_seed(0)
    for name in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for length in (int(x) for x in args.lengths.split(",")):
                sd, kn, pg, diff = case(kernel, dtypes[name], batch, length, args.rounds)
                row = f"{name:<6}{batch:>6}{length:>8}{sd:>10.1f}{kn:>10.1f}{sd / kn:>9.2f}x{pg:>10.1f}"
                print(f"{row}{pg / kn:>11.2f}x{diff:>11.1e}")
    print(f"kernel: {why}")


if __name__ == "__main__":
    main()
