"""What the *_ablation.py benchmarks share: each variant is a whole `gpuwise train` run in a fresh process (a
child that trains the variant's workload: a subclass of the built-in one with another recipe, named as
`module:Class`), one after another, each printed as a table row when it finishes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path


def train_child(child: str, argv: list[str], out: Path, name: str) -> dict:
    """The summary of `gpuwise train ... --json` run by the `child` program, its record kept under `out`."""
    env = dict(os.environ, GPUWISE_DB=str(out / "runs.sqlite"))
    done = subprocess.run([sys.executable, "-c", child, *argv], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


def main(
    doc: str,
    variants: Collection[str],
    first: list[str],
    title: str,
    run: Callable[[str, int, Path], dict],
    cols: tuple[str, ...],
    width: int,
) -> None:
    """Parse --variants and --seed, then run each variant (`run(name, seed, out)` returns its row: `cols`,
    epochs and wall_s) and print it."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--variants", default=",".join(first), help="comma-separated, or all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = list(variants) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in variants]
    if unknown:
        ap.error(f"unknown variant {', '.join(unknown)} (of {', '.join(variants)})")
    out = Path(tempfile.mkdtemp(prefix="ablation-"))
    print(f"{title}, seed {args.seed}, {os.cpu_count()} CPUs; runs in {out}")
    print(f"{'variant':<15}{'epochs':>7}" + "".join(f"{c:>{width}}" for c in cols) + f"{'wall':>8}")
    for name in names:
        r = run(name, args.seed, out)
        cells = "".join(f"{r[c]:>{width}.4f}" for c in cols)
        print(f"{name:<15}{r['epochs']:>7.0f}{cells}{r['wall_s']:>7.0f}s", flush=True)
