"""The CPU training step with glibc's default allocator vs gpuwise's (freed memory kept, no mmap):
time per step, page faults per step and peak resident set, side by side in fresh processes.

    python benchmarks/cpu_allocator.py [--batch 16] [--steps 8] [--rounds 3]
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
from gpuwise.hardware.cpu import retain_freed_memory
from gpuwise.workloads.defects import DefectCNN
if sys.argv[1] == "gpuwise":
    assert retain_freed_memory()
batch, steps = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = DefectCNN()
opt = torch.optim.AdamW(model.parameters(), 1e-3)
x, y = torch.randn(batch, 1, 128, 128), torch.rand(batch)
times, faults = [], []
for i in range(steps):
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
steady = sorted(times[2:])
print(json.dumps({"step_s": steady[len(steady) // 2], "faults": sorted(faults[2:])[len(faults[2:]) // 2],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(mode: str, batch: int, steps: int) -> dict:
    env = {"OMP_NUM_THREADS": "1", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(batch), str(steps)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"defects CNN step, batch {args.batch}, 1 thread, median of steps 3..{args.steps}, fresh process each")
    print(f"{'round':>5} {'allocator':>10} {'step s':>8} {'faults/step':>12} {'peak RSS MB':>12}")
    ratios = []
    for r in range(args.rounds):
        got = {mode: run(mode, args.batch, args.steps) for mode in ("glibc", "gpuwise")}
        for mode, m in got.items():
            print(f"{r + 1:>5} {mode:>10} {m['step_s']:>8.3f} {m['faults']:>12} {m['peak_rss_mb']:>12.0f}")
        ratios.append(got["glibc"]["step_s"] / got["gpuwise"]["step_s"])
    print("speed-up (glibc step / gpuwise step): " + ", ".join(f"{x:.2f}x" for x in ratios))


if __name__ == "__main__":
    main()
