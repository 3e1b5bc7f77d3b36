"""What each lever buys the defects workload on ELPV: one full training run per variant, in fresh processes
one after another, each scored on the same test cells.

Run: .venv/bin/python benchmarks/defects_ablation.py [--variants default,plain-conv,...] [--seed 0]

Variants (each the default run, `gpuwise train defects`, with one change):
  default      weight-standardized convolutions, hard labels, flips and 90-degree turns, threshold from the
               validation cells
  plain-conv   plain convolutions (defects.WEIGHT_STANDARDIZATION = False, the default until 2026-12-02)
  20-epochs    --epochs 20
  soft         ELPV's own defect probabilities (0, 1/3, 2/3, 1) as targets instead of 0/1 (defects.SOFT_TARGETS)
  jitter       brightness and contrast jitter of +-20 % on top of the flips and turns (defects.JITTER = 0.2)

Per variant: accuracy, recall and precision of "defective" at the threshold chosen on the validation cells,
accuracy and recall at 0.5 (the published figure's rule), ROC-AUC, and the run's wall time. One run per
variant takes 2-6 minutes on 2 cores; a difference of a point or so between two variants is within what
another seed moves (not measured here for every variant: run it with --seed 1 and 2 to see).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "default": ({}, []),
    "plain-conv": ({"WEIGHT_STANDARDIZATION": False}, []),
    "20-epochs": ({}, ["--epochs", "20"]),
    "soft": ({"SOFT_TARGETS": True}, []),
    "jitter": ({"JITTER": 0.2}, []),
}

CHILD = """
import sys
import gpuwise.workloads.defects as d
for name, value in {switches!r}.items():
    setattr(d, name, value)
from gpuwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, seed: int, out: Path) -> dict:
    switches, flags = VARIANTS[name]
    run_dir = out / name
    argv = ["train", "defects", *flags, "--seed", str(seed), "--run-dir", str(run_dir), "--json"]
    env = dict(os.environ, GPUWISE_DB=str(out / "runs.sqlite"))
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(switches=switches), *argv], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr.strip().splitlines()[-1]}")
    s = json.loads(done.stdout)
    e = s["eval"]
    return {
        "accuracy": e["accuracy"],
        "recall": e["recall"],
        "precision": e["precision"],
        "threshold": e["threshold"],
        "accuracy@0.5": e["accuracy@0.5"],
        "recall@0.5": e["recall@0.5"],
        "roc_auc": e["roc_auc"],
        "wall_s": s["wall_s"],
        "epochs": s["epochs"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {', '.join(unknown)} (of {', '.join(VARIANTS)})")
    out = Path(tempfile.mkdtemp(prefix="defects-ablation-"))
    print(f"ELPV defects, seed {args.seed}, {os.cpu_count()} CPUs; runs in {out}")
    cols = ("accuracy", "recall", "precision", "threshold", "accuracy@0.5", "recall@0.5", "roc_auc")
    print(f"{'variant':<12}{'epochs':>7}" + "".join(f"{c:>14}" for c in cols) + f"{'wall':>8}")
    for name in names:
        r = run(name, args.seed, out)
        cells = "".join(f"{r[c]:>14.4f}" for c in cols)
        print(f"{name:<12}{r['epochs']:>7.0f}{cells}{r['wall_s']:>7.0f}s", flush=True)


if __name__ == "__main__":
    main()
