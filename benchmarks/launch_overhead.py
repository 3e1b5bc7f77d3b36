"""The cost of an engine: the same 2-worker training job through Ray (`gpuwise launch ray --submit`) and
through torchrun directly, side by side.

Run: .venv/bin/python benchmarks/launch_overhead.py [--steps 200] [--rounds 3] [--workload recommender]

Both run here on CPU processes (gloo), alternating (torchrun, Ray, torchrun, Ray, ...) so that the machine's
load falls on both alike. Printed per engine:
- cluster start: `ray start --head` until it answers (torchrun has none), once;
- gpuwise launch: the `gpuwise launch ray --submit` command itself (the plan: the workload built and one
  step timed here; the cluster checked; the job submitted);
- start-up: from the job's start (torchrun's launch; Ray's accepted submission) to its end, minus the run's
  own training wall time (summary.json): process start, imports, data, model, rendezvous, evaluation and
  saving, and for Ray the job driver, the runtime_env upload and the placement group;
- per step: the median training step, from the run's summary;
- end to end: launch (or submit) to the job's end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(args, run_dir: Path) -> list[str]:
    extra = ["--model", "mf"] if args.workload == "recommender" else ["--image-size", "64"]
    return ["train", args.workload, *extra, "--max-steps", str(args.steps), "--batch-size", "16",
            "--precision", "32-true", "--checkpoint-every", str(args.steps), "--run-dir", str(run_dir)]  # fmt: skip


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def torchrun(args, where: Path, n: int) -> dict:
    run = where / f"torchrun-{n}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gpuwise",
            *job(args, run), "--devices", "2", "--accelerator", "cpu"]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    total = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-2000:]
    return measured(run, total)


def ray_job(args, where: Path, n: int, address: str) -> dict:
    from ray.job_submission import JobSubmissionClient

    run = where / f"ray-{n}"
    t0 = time.perf_counter()
    done = subprocess.run([str(BIN / "gpuwise"), "launch", "ray", "--gpu", "cpu", "--gpus", "2", "--submit",
                           "--address", address, "--python", sys.executable, "--json", "--", *job(args, run)],
                          capture_output=True, text=True, cwd=where)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    submitted = time.perf_counter()
    job_id = json.loads(done.stdout)["job_id"]
    client = JobSubmissionClient(address)
    while (state := client.get_job_status(job_id).value) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        time.sleep(0.2)
    end = time.perf_counter()
    assert state == "SUCCEEDED", client.get_job_logs(job_id)[-2000:]
    return measured(run, end - submitted) | {"launch": submitted - t0, "total": end - t0}


def measured(run: Path, job_s: float) -> dict:
    s = summary(run)
    return {"launch": 0.0, "total": job_s, "startup": job_s - s["wall_s"], "step": s["actual"]["step_time_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="recommender", choices=["recommender", "defects"])
    args = p.parse_args()
    print(f"host: {os.cpu_count()} CPUs; workload {args.workload}, {args.steps} steps, 2 CPU processes (gloo)")
    dashboard, gcs = free_port(), free_port()
    t0 = time.perf_counter()
    started = subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--port", str(gcs),
                              "--dashboard-port", str(dashboard), "--include-dashboard", "true",
                              "--disable-usage-stats"], capture_output=True, text=True)  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    address = f"http://127.0.0.1:{dashboard}"
    from ray.job_submission import JobSubmissionClient

    while True:  # the Jobs API answers once the dashboard's agent is up
        try:
            JobSubmissionClient(address).list_jobs()
            break
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    cluster_s = time.perf_counter() - t0
    rows: dict[str, list[dict]] = {"torchrun": [], "ray": []}
    try:
        with tempfile.TemporaryDirectory(prefix="launch-overhead-") as tmp:
            where = Path(tmp)
            for n in range(args.rounds):
                rows["torchrun"].append(torchrun(args, where, n))
                rows["ray"].append(ray_job(args, where, n, address))
                t, r = rows["torchrun"][-1]["total"], rows["ray"][-1]["total"]
                print(f"round {n + 1}: torchrun {t:.1f} s, ray {r:.1f} s")
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True)
    keys = ("launch", "total", "startup", "step")
    med = {k: {m: statistics.median(r[m] for r in v) for m in keys} for k, v in rows.items()}
    print(f"\nmedians of {args.rounds} rounds")
    head = ("engine", "cluster start", "gpuwise launch", "start-up", "per step", "end to end")
    print("{:10} {:>14} {:>15} {:>10} {:>10} {:>11}".format(*head))
    for name, m in med.items():
        cluster, launch = (f"{cluster_s:.1f} s", f"{m['launch']:.1f} s") if name == "ray" else ("-", "-")
        print(f"{name:10} {cluster:>14} {launch:>15} {m['startup']:>8.1f} s {m['step'] * 1e3:>7.2f} ms "
              f"{m['total']:>9.1f} s")  # fmt: skip
    t, r = med["torchrun"], med["ray"]
    print(f"ray / torchrun: start-up {r['startup'] / t['startup']:.2f}x (+{r['startup'] - t['startup']:.1f} s), "
          f"per step {r['step'] / t['step']:.3f}x, end to end {r['total'] / t['total']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
