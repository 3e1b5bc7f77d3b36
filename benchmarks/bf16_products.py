"""bf16 products of many rows (a prompt's chunk, many streams), side by side on one host: the kernel's AMX
tiles reading the plain weight as it is stored, oneDNN's product on its packed copy (what a bf16 model served on
a CPU holds beside the plain weight), and `F.linear` on the plain weight (oneDNN reordering it each call).

The question it answers: can a bf16 model hold its weights once (the plain copy, which the decode kernels read)
and lose no speed at many rows? Shapes are SmolLM2-135M's products as the fused decoder holds them (q|k|v and
gate|up joined, the tied output layer). Weights rotate through copies larger than the last-level cache, as a
step's 30 layers do. Interleaved rounds, median ms of a layer's products, and each way's output against oneDNN's.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bf16_products.py [--rows 9,16,32,64,128,256,512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpuwise.serve.engines.gpuwise.attention import load
from gpuwise.serve.engines.gpuwise.packed import ONEDNN, Packed

# (out, in) of one layer's products in the fused decoder, and the output layer
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)
COPIES_BYTES = 1 << 30  # rotated weights: well past any cache this benchmark meets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="9,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="the output layer (49152 x 576) instead of a layer")
    args = ap.parse_args()
    kernel, why = load()
    if kernel is None or not kernel.amx:
        raise SystemExit(f"needs the kernel with AMX's tiles granted: {why}; amx={getattr(kernel, 'amx', None)}")
    torch.manual_seed(0)
    shapes = {"head": HEAD} if args.head else LAYER
    per_copy = sum(o * i * 2 for o, i in shapes.values())
    n = max(2, COPIES_BYTES // per_copy)
    copies = [{k: torch.randn(o, i, dtype=torch.bfloat16) / i**0.5 for k, (o, i) in shapes.items()} for _ in range(n)]
    packed = [{k: Packed(w, None, ONEDNN) for k, w in c.items()} for c in copies]
    print(f"{torch.get_num_threads()} threads; {n} copies of {per_copy / 1e6:.1f} MB of weights rotated")
    print(f"{'rows':>5} {'AMX tiles, plain':>17} {'oneDNN packed':>14} {'F.linear plain':>15}"
          f" {'packed / tiles':>15} {'max |tiles - packed|':>21}")  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, i, dtype=torch.bfloat16) for k, (_, i) in shapes.items()}
        ways = {
            "tiles": lambda c, p, xs=xs: [kernel.gemv(xs[k], c[k]) for k in shapes],
            "packed": lambda c, p, xs=xs: [p[k](xs[k]) for k in shapes],
            "linear": lambda c, p, xs=xs: [F.linear(xs[k], c[k]) for k in shapes],
        }
        times: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(args.rounds + 1):
            for name, way in ways.items():
                t0 = time.perf_counter()
                for c, p in zip(copies, packed, strict=True):
                    way(c, p)
                if r:  # the first round warms up
                    times[name].append((time.perf_counter() - t0) / n * 1e3)
        pairs = zip(ways["tiles"](copies[0], packed[0]), ways["packed"](copies[0], packed[0]), strict=True)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{rows:>5} {med['tiles']:>14.3f} ms {med['packed']:>11.3f} ms {med['linear']:>12.3f} ms"
              f" {med['packed'] / med['tiles']:>14.2f}x {diff:>21.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
