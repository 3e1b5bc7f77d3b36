"""The driver of a gpuwise endpoint on Ray (`gpuwise launch ray -- serve MODEL`), run by Ray on the cluster:

    python -m gpuwise.launch.ray_serve --replicas N --cpus C [--gpus G --accelerator-type NAME] --run-dir DIR
        -- serve MODEL ... --host 0.0.0.0 --port 0

One placement-group bundle per replica (spread over nodes where it can be) holds the replica's GPUs and CPUs;
a task in each runs `gpuwise serve`, which announces its address (node IP and the port it bound) in
DIR/replica-I.json. `ray job stop` sends the driver TERM: it cancels each replica's task, whose worker then
sends its server TERM and waits while the server drains its in-flight requests (the job's runtime_env gives
Ray's supervisor RAY_JOB_STOP_WAIT_TIME_S for it). A server whose worker dies otherwise gets TERM too
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpuwise.launch.endpoint import DRAIN_S
from gpuwise.launch.ray_nodes import RESERVE_TIMEOUT_S, bundle_of

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _term_with_parent() -> None:
    """In the server's process, before exec: TERM when the Ray worker that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@ray.remote
def run_replica(serve: list[str], announce: str) -> int:
    env = dict(os.environ, GPUWISE_ANNOUNCE_HOST=ray.util.get_node_ip_address())
    # Ray sets OMP_NUM_THREADS to the task's CPUs; serve's own rule (plan/serving.py: compute_threads) decides,
    # and serve --threads overrides it.
    env.pop("OMP_NUM_THREADS", None)
    env.pop("GPUWISE_API_KEY", None)  # the key file decides
    cmd = [sys.executable, "-m", "gpuwise", *serve, "--announce", announce]
    # A session of its own: a signal Ray sends the worker's group is not the server's; the worker decides.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_term_with_parent, start_new_session=True)
    try:
        while True:  # in short waits: Ray's cancel interrupts Python between them, never inside waitpid
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:  # ray.cancel: the endpoint is stopping. TERM, and the server drains.
        proc.send_signal(signal.SIGTERM)
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuwise.launch.ray_serve")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--cpus", type=int, required=True)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--accelerator-type")
    p.add_argument("--run-dir", required=True)
    p.add_argument("serve", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    serve = args.serve[1:] if args.serve[:1] == ["--"] else args.serve
    ray.init()
    bundle = bundle_of(args.cpus, args.gpus, args.accelerator_type)
    group = placement_group([bundle] * args.replicas, strategy="SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        print(f"gpuwise: the cluster could not reserve {args.replicas} x {bundle} in {RESERVE_TIMEOUT_S} s",
              file=sys.stderr)  # fmt: skip
        return 1
    plain = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    runs = [
        run_replica.options(
            num_cpus=args.cpus,
            num_gpus=args.gpus,
            resources=plain,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote(serve, os.path.join(args.run_dir, f"replica-{i}.json"))
        for i in range(args.replicas)
    ]
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # `ray job stop`
    pending, codes = list(runs), []
    while pending and not stopping.is_set():
        done, pending = ray.wait(pending, timeout=1)
        codes += ray.get(done)
    if stopping.is_set():
        for ref in pending:
            ray.cancel(ref, force=False)  # KeyboardInterrupt in the task: it has its server drain
        ray.wait(pending, num_returns=len(pending), timeout=DRAIN_S + 10)
        return 0
    return next((1 if rc < 0 else rc for rc in codes if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
