"""How fast is `gpuwise plan`? A full-catalog sweep against the bare interpreter start-up.

Run: .venv/bin/python benchmarks/plan_speed.py [--repeat N]

Prints, side by side from one run: the start-up of `python -c pass`, the import of the planner,
one in-process sweep for a few requests, and the whole CLI process (`gpuwise plan ... --json`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    # A benchmark measures; it does not belong in the user's run record.
    os.environ["GPUWISE_DB"] = str(Path(tempfile.mkdtemp()) / "benchmark-runs.sqlite")
    py = sys.executable

    bare = wall([py, "-c", "pass"], args.repeat)
    imports = wall([py, "-c", "import gpuwise.plan.planner, gpuwise.hardware.catalog"], args.repeat)
    cli = wall([py, "-m", "gpuwise", "plan", "--model", "llama-3.1-8b", "--task", "qlora", "--json"], args.repeat)

    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.plan.model import resolve_model
    from gpuwise.plan.planner import make_plan
    from gpuwise.plan.request import PlanRequest

    catalog = load_catalog()
    requests = {
        "llama-3.1-8b qlora": ("llama-3.1-8b", PlanRequest(task="qlora")),
        "llama-3.1-70b inference": ("llama-3.1-70b", PlanRequest(task="inference", batch=8)),
        "llama-3.1-405b pretrain": ("llama-3.1-405b", PlanRequest(task="pretrain", checkpointing="full")),
    }
    rows = []
    for name, (model, req) in requests.items():
        spec = resolve_model(model)
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = make_plan(spec, req, catalog)
            times.append(time.perf_counter() - t)
        rows.append((name, statistics.median(times), len(res["options"])))

    print(f"python {sys.version.split()[0]}, median of {args.repeat} runs")
    print(f"{'what':<44}{'seconds':>10}{'x start-up':>12}")
    print(f"{'bare interpreter start-up (python -c pass)':<44}{bare:>10.4f}{1:>12.2f}")
    print(f"{'start-up + import the planner':<44}{imports:>10.4f}{imports / bare:>12.2f}")
    for name, t, n in rows:
        print(f"{'sweep, in process: ' + name + f' ({n})':<44}{t:>10.4f}{t / bare:>12.2f}")
    print(f"{'whole CLI: gpuwise plan ... --json':<44}{cli:>10.4f}{cli / bare:>12.2f}")
    print("torch imported by the planner:", "torch" in sys.modules)


if __name__ == "__main__":
    main()
