"""gpuwise on a real GPU, in one bounded run: what the machine is, how close its measured rates come to the
catalog's peak, the CUDA-only tests, short runs of the three workloads (planned vs actual memory and step
time, MFU), and the LLM endpoint under load. Every figure goes into one JSON file; a short table goes to
stdout.

Run: bash benchmarks/gpu_truth.sh [--out DIR] [--budget SECONDS] [--dry-run]

Each step is a subprocess under its own timeout, and all of them under --budget (default 450 s, so the whole
script stays under 8 minutes with its start-up): a step that would start with less than its minimum left is
skipped and says so. A failing step is recorded (exit code, last lines of its output) and the next one runs.

Without CUDA the script says so in one line, runs what means something on a CPU (devices, bench --quick,
3-step workload runs) and exits 0. --dry-run runs nothing: it checks the arguments, prints each step's
command and timeout, and writes the JSON with every figure null, so CI checks the script and its output's
shape on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # short runs: enough steps for a median step time after the first (compile, allocator warm-up)
    "defects": ["--max-steps", "20"],
    "recommender": ["--max-steps", "20"],
    "product-lm": ["--max-steps", "8"],
}
SCHEMA = 1


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout: int  # seconds
    needs_cuda: bool = False
    minimum: int = 20  # not started with less than this left of the budget
    result: dict = field(default_factory=dict)


def gpuwise(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuwise", *args]


def gpu_tests(xml: Path) -> list[str]:
    """The CUDA-only tests, their results as junit XML."""
    test_file = ROOT / "tests" / "test_gpu.py"
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        str(test_file),
        f"--junitxml={xml}",
    ]


def steps(out: Path, cuda: bool) -> list[Step]:
    """The checks in order; on a CPU the ones that mean nothing there are left out, and the runs are shorter."""
    device = "cuda" if cuda else "cpu"
    plan = [
        Step("devices", gpuwise("devices", "--json"), 60),
        Step("bench", gpuwise("bench", "--quick", "--json", "--device", device, "--out", str(out / "bench")), 150),
        Step(
            "gpu tests",
            gpu_tests(out / "gpu_tests.xml"),
            180,
            needs_cuda=True,
        ),
    ]
    for name, extra in WORKLOADS.items():
        extra = extra if cuda else ["--max-steps", "3"]
        argv = gpuwise("train", name, *extra, "--run-dir", str(out / "runs" / name), "--json")
        plan.append(Step(f"train {name}", argv, 150, minimum=30))
    # vLLM beside gpuwise's engine where the machine has it (the GPU machine reaches no package index: it
    # must be in its image, or named by GPUWISE_VLLM_PYTHON)
    from gpuwise.serve.engines.vllm import find_vllm

    vllm = find_vllm(None) if cuda else None
    servers = ["--servers", "gpuwise,gpuwise-vllm,vllm", "--vllm-python", vllm[0]] if vllm else ["--servers", "gpuwise"]
    plan.append(
        Step(
            "llm endpoint",
            [
                sys.executable,
                "benchmarks/llm_serve_load.py",
                *servers,
                "--dtypes",
                "bf16",
                "--levels",
                "1,32",
                "--rounds",
                "1",
                "--device",
                device,
                "--json",
                str(out / "llm_serve_load.json"),
            ],
            420 if vllm else 240,  # vLLM captures CUDA graphs as it starts: a minute or two
            needs_cuda=True,
            minimum=90,
        )
    )
    # the serving capacity plan against the engine measured under Poisson load (docs/plan.md): vLLM where the
    # machine has it, else gpuwise's engine; targets tight enough that the knee is within the client's reach
    plan.append(
        Step(
            "serving capacity",
            [
                sys.executable,
                "benchmarks/capacity_vs_actual.py",
                "--engines",
                "vllm" if vllm else "gpuwise",
                "--requests",
                "200",
                "--prompt",
                "512",
                "--output",
                "128",
                "--ttft",
                "0.2",
                "--tpot",
                "0.02",
                "--rates",
                "0.5,0.9,1.25",
                "--out",
                str(out / "capacity_vs_actual.json"),
            ],
            420 if vllm else 300,
            needs_cuda=True,
            minimum=180,
        )
    )
    return [s for s in plan if cuda or not s.needs_cuda]


def run_step(step: Step, left: float, env: dict) -> None:
    if left < step.minimum:
        step.result = {"status": "skipped", "why": f"{left:.0f} s of the budget left, the step needs {step.minimum}"}
        return
    timeout = int(min(step.timeout, left))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(step.argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        step.result = {
            "status": "timeout",
            "seconds": timeout,
            "tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
        }
        return
    seconds = time.perf_counter() - t0
    step.result = {"status": "ok" if done.returncode == 0 else "failed", "rc": done.returncode, "seconds": seconds}
    if done.returncode != 0:
        step.result["tail"] = (done.stdout + done.stderr)[-1500:]
    step.result["stdout"] = done.stdout


def figures_devices(stdout: str) -> dict:
    d = json.loads(stdout)
    return {"cuda": d.get("cuda", []), "train_default": d.get("train_default")}


def figures_bench(stdout: str) -> dict:
    """Per device: each dtype's matmul TFLOP/s and share of the catalog's peak, bandwidth, host<->device."""
    b = json.loads(stdout)
    out = {}
    for name, dev in b["devices"].items():
        out[name] = {
            "matmul": {k: {"tflops": m["tflops"], "of_peak": m["fraction_of_peak"]} for k, m in dev["matmul"].items()},
            "bandwidth_gbs": dev["bandwidth"]["triad_gbs"],
            "bandwidth_of_peak": dev["bandwidth"]["fraction_of_peak"],
            "host_device_gbs": (dev.get("host_device") or {}).get("h2d_gbs"),
        }
    return out


def figures_train(stdout: str) -> dict:
    """Planned vs actual peak memory and step time of a run, its MFU, and how each was measured."""
    s = json.loads(stdout)
    plan, actual = s["plan"], s["actual"]
    return {
        "device": s["device"],
        "precision": s["precision"],
        "steps": s["steps"],
        "plan_peak_bytes": plan.get("peak_bytes"),
        "actual_peak_bytes": actual.get("peak_bytes"),
        "memory_error": s["estimate_error"].get("peak_bytes"),
        "plan_step_s": plan.get("step_time_s"),
        "actual_step_s": actual.get("step_time_s"),
        "step_error": s["estimate_error"].get("step_time_s"),
        "mfu": s.get("mfu"),
        "memory_method": actual.get("method"),
        # the devices' use as the run sampled it: NVML on a GPU (hardware/usage.py), its CPU share otherwise
        "use": {k: (s.get("utilization") or {}).get(k) for k in ("kind", "mean", "idle_share", "mean_power_w",
                                                                 "peak_memory_share", "samples")},  # fmt: skip
    }


def figures_gpu_tests(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [
        c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None
    ]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"failed": failed}


def figures_llm(path: Path) -> dict:
    return json.loads(path.read_text())


def collect(step: Step, out: Path) -> dict | None:
    """The figures a finished step produced, None where it produced none."""
    if step.result.get("status") != "ok":
        return None
    stdout = step.result.get("stdout", "")
    if step.name == "devices":
        return figures_devices(stdout)
    if step.name == "bench":
        return figures_bench(stdout)
    if step.name == "gpu tests":
        return figures_gpu_tests(out / "gpu_tests.xml")
    if step.name.startswith("train "):
        return figures_train(stdout)
    if step.name == "llm endpoint":
        return figures_llm(out / "llm_serve_load.json")
    if step.name == "serving capacity":
        return figures_capacity(out / "capacity_vs_actual.json")
    return None


def figures_capacity(path: Path) -> dict:
    """Per engine: the knee planned and measured, and each replayed rate's throughput and TPOT p50, plan and
    measured."""
    out = {}
    for res in json.loads(path.read_text()):
        out[res["engine"]] = {
            "planned_knee": res["planned_knee"],
            "measured_knee": res["measured_knee"],
            "rows": [
                {
                    "rate": row["rate"],
                    "throughput": [row["plan"]["throughput"], row["measured"]["throughput"]],
                    "tpot_p50": [row["plan"]["tpot_p50"], row["measured"]["tpot_p50"]],
                }
                for row in res["rows"]
            ],
        }
    return out


def table(report: dict) -> str:
    """The short table for stdout: one line per step, then the runs' plan vs actual."""
    lines = [f"{'step':<22}{'status':<10}{'s':>6}  figures"]
    for name, r in report["steps"].items():
        f = r.get("figures") or {}
        said = ""
        if name == "bench" and f:
            dev = next(iter(f.values()))
            said = ", ".join(
                f"{k} {m['tflops']:.1f} TFLOP/s" + (f" ({m['of_peak']:.0%} of peak)" if m["of_peak"] else "")
                for k, m in dev["matmul"].items()
            )
            said += f"; triad {dev['bandwidth_gbs']:.0f} GB/s"
        elif name.startswith("train ") and f:
            mem = f"{f['memory_error']:+.0%}" if f["memory_error"] is not None else "-"
            step = f"{f['step_error']:+.0%}" if f["step_error"] is not None else "-"
            mfu = f"{f['mfu']:.1%}" if f["mfu"] else "-"
            said = f"{f['device']} {f['precision']}: memory {mem}, step time {step} (plan vs actual), MFU {mfu}"
            use = f.get("use") or {}
            if use.get("mean") is not None:
                watts = f", {use['mean_power_w']:.0f} W" if use.get("mean_power_w") else ""
                said += f"; use {use['mean']:.0%} ({use['kind']}, {use['samples']} samples{watts})"
        elif name == "gpu tests" and f:
            said = f"{f['tests']} tests, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"
        elif name == "llm endpoint" and f:
            said = "; ".join(f"c={r['concurrency']} {r['tokens_per_s']:.0f} tok/s" for r in f["rows"])
        elif name == "serving capacity" and f:
            said = "; ".join(
                f"{engine}: knee planned {e['planned_knee']:.1f}/s, measured "
                + (f"{e['measured_knee']:.1f}/s" if e["measured_knee"] else "not crossed")
                + ", throughput "
                + " ".join(f"{p / m - 1:+.0%}" for p, m in (r["throughput"] for r in e["rows"]) if m)
                for engine, e in f.items()
            )
        elif r.get("why"):
            said = r["why"]
        elif r.get("status") in ("failed", "timeout"):
            said = (r.get("tail") or "").strip().splitlines()[-1:][0] if (r.get("tail") or "").strip() else ""
        seconds = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "-"
        lines.append(f"{name:<22}{r.get('status', '-'):<10}{seconds:>6}  {said}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.environ.get("OUT") or time.strftime("benchmarks/out/gpu_truth-%Y%m%d-%H%M%S")
    ap.add_argument("--out", type=Path, default=Path(default_out), help="folder for the JSON, runs, logs [$OUT]")
    ap.add_argument("--budget", type=int, default=450, help="seconds for all steps together")
    ap.add_argument("--dry-run", action="store_true", help="run nothing: print the steps, write the JSON's shape")
    ap.add_argument("--only", help="run these steps alone, comma-separated (a second call: 'serving capacity')")
    args = ap.parse_args()
    if args.budget < 1:
        ap.error("--budget must be at least 1 second")

    try:
        import torch
    except ImportError:
        if not args.dry_run:
            ap.error(f'{sys.executable} has no torch (README, "On a GPU")')
        torch = None  # a dry run needs none: it lists the steps a CUDA machine would run
    cuda = torch is not None and torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("gpu_truth: no CUDA device here; running the CPU parts only (devices, bench, 3-step runs)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # the runs' records go to their own database, not the user's
    # (gpuwise itself may come from src/ on PYTHONPATH: gpu_truth.sh puts it there on a machine without .venv)
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, GPUWISE_DB=str(out / "runs.sqlite"), PYTHONPATH=path)
    plan = steps(out, cuda or args.dry_run)  # a dry run lists every step, as a CUDA machine would run them
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in plan}]
        if unknown:
            ap.error(f"--only {', '.join(unknown)}: no such step (steps: {', '.join(s.name for s in plan)})")
        plan = [s for s in plan if s.name in names]
    report: dict = {
        "schema": SCHEMA,
        "dry_run": args.dry_run,
        "cuda": cuda,
        "torch": torch.__version__ if torch is not None else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "budget_s": args.budget,
        "steps": {},
    }
    start = time.perf_counter()
    for step in plan:
        if args.dry_run:
            print(f"{step.name:<22}timeout {step.timeout:>4} s  {shlex.join(step.argv)}")
            step.result = {"status": "dry-run"}
        else:
            print(f"gpu_truth: {step.name} ...", file=sys.stderr, flush=True)
            run_step(step, args.budget - (time.perf_counter() - start), env)
        try:
            figures = collect(step, out)
        except (ValueError, KeyError, OSError) as e:  # output of an unexpected shape: recorded, not fatal
            figures, step.result["parse_error"] = None, f"{type(e).__name__}: {e}"
        entry = {k: v for k, v in step.result.items() if k != "stdout"}
        report["steps"][step.name] = entry | {
            "command": shlex.join(step.argv),
            "timeout_s": step.timeout,
            "figures": figures,
        }
    report["seconds"] = time.perf_counter() - start
    path = out / "gpu_truth.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"every figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
