"""Products of many rows (a prompt's chunk, many streams) by quantized weights, side by side on one host: the
kernel's own product reading the blocks as they are held (int8 activations on VNNI, or AMX's tiles where granted),
the library's way (`decoder._Linear._qlinear`: a chunk of the weight's rows dequantized to bf16, then oneDNN's
product), and, for scale, oneDNN's product on a packed bf16 copy (what a bf16 model served on a CPU multiplies).

The question it answers: from how many rows on should a quantized product leave the kernel for the library
(`decoder.LIBRARY_ROWS`)? At 32 streams every product of a step has 32 rows, so where the kernel is ahead there,
int8 and int4 keep their lead over bf16 at many streams instead of dequantizing every weight every step.
Shapes are SmolLM2-135M's products as the fused decoder holds them (q|k|v and gate|up joined; `--head`: the tied
output layer), the weights as `gpuwise serve --weights` holds them (four rows at a time, quant.interleave), rotated
through copies larger than the last-level cache, as a step's 30 layers are. Interleaved rounds; median ms of a
layer's products; each way's largest difference from the dequantized weight's exact product (fp32), against the
output's size.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/quant_products.py [--weights int8,int4]
        [--rows 8,12,16,24,32,48,64,128] [--head]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bf16_products import HEAD, LAYER  # beside this script: the same shapes

from gpuwise.serve.engines.gpuwise.attention import load
from gpuwise.serve.engines.gpuwise.decoder import _Linear
from gpuwise.serve.engines.gpuwise.packed import ONEDNN, Packed
from gpuwise.serve.engines.gpuwise.quant import WEIGHTS, dequantize

COPIES_BYTES = 512 << 20  # rotated bf16 weights: past the last-level caches this benchmark meets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--rows", default="8,12,16,24,32,48,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="the output layer (49152 x 576) instead of a layer")
    args = ap.parse_args()
    kernel, why = load()
    if kernel is None:
        raise SystemExit(f"needs gpuwise's CPU kernel: {why}")
    torch.manual_seed(0)
    shapes = {"head": HEAD} if args.head else LAYER
    per_copy = sum(o * i * 2 for o, i in shapes.values())
    n = max(2, COPIES_BYTES // per_copy)
    plain = [{k: torch.randn(o, i, dtype=torch.bfloat16) / i**0.5 for k, (o, i) in shapes.items()} for _ in range(n)]
    packed = [{k: Packed(w, None, ONEDNN) for k, w in c.items()} for c in plain]
    print(f"{torch.get_num_threads()} threads; AMX's tiles: {kernel.amx}; {n} copies of {per_copy / 1e6:.1f} MB "
          f"of bf16 weights rotated")  # fmt: skip
    for weights in args.weights.split(","):
        if not WEIGHTS.get(weights):
            raise SystemExit(f"--weights: {weights!r} is not one of {[k for k, v in WEIGHTS.items() if v]}")
        fmt = WEIGHTS[weights][0]
        held = []
        for c in plain:
            lins = {k: _Linear(w, None, None, kernel) for k, w in c.items()}
            for lin in lins.values():
                lin.quantize(fmt)
            held.append(lins)
        print(f"\n{weights} ({held[0]['head' if args.head else 'qkv'].quant.fmt.name}):")
        print(f"{'rows':>5} {'kernel':>10} {'library':>10} {'bf16 packed':>12} {'library / kernel':>17}"
              f" {'err kernel':>11} {'err library':>12}")  # fmt: skip
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, i, dtype=torch.bfloat16) for k, (_, i) in shapes.items()}
            ways = {
                "kernel": lambda q, p, xs=xs: [q[k].kernel.qgemv(xs[k], q[k].quant) for k in shapes],
                "library": lambda q, p, xs=xs: [q[k]._qlinear(xs[k]) for k in shapes],
                "packed": lambda q, p, xs=xs: [p[k](xs[k]) for k in shapes],
            }
            times: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.rounds + 1):
                order = list(ways.items()) if r % 2 else list(reversed(ways.items()))
                for name, way in order:
                    t0 = time.perf_counter()
                    for q, p in zip(held, packed, strict=True):
                        way(q, p)
                    if r:  # the first round warms up
                        times[name].append((time.perf_counter() - t0) / n * 1e3)
            exact = [F.linear(xs[k].float(), dequantize(held[0][k].quant, torch.float32)) for k in shapes]
            scale = max(float(e.abs().max()) for e in exact)

            def err(outs: list[torch.Tensor], exact: list[torch.Tensor] = exact, scale: float = scale) -> float:
                return max(float((o.float() - e).abs().max()) for o, e in zip(outs, exact, strict=True)) / scale

            e_kernel, e_library = err(ways["kernel"](held[0], packed[0])), err(ways["library"](held[0], packed[0]))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{rows:>5} {med['kernel']:>7.3f} ms {med['library']:>7.3f} ms {med['packed']:>9.3f} ms"
                  f" {med['library'] / med['kernel']:>16.2f}x {e_kernel:>11.1e} {e_library:>12.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
