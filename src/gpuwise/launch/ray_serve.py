"""The driver of a gpuwise endpoint on Ray (`gpuwise launch ray -- serve MODEL`), run by Ray on the cluster:

    python -m gpuwise.launch.ray_serve --replicas N --cpus C [--gpus G --accelerator-type NAME] --run-dir DIR
        -- serve MODEL ... --host 0.0.0.0 --port 0

One placement-group bundle per replica (spread over nodes where it can be) holds the replica's GPUs and CPUs;
an actor in each runs `gpuwise serve`, which announces its address (node IP and the port it bound) in
DIR/replica-I.json. `ray job stop` sends the driver TERM: it asks each replica's actor to stop, which sends
its server TERM and waits while the server drains its in-flight requests (the job's runtime_env gives Ray's
supervisor RAY_JOB_STOP_WAIT_TIME_S for it). A server whose actor dies otherwise gets TERM too
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
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpuwise.launch.endpoint import DRAIN_S
from gpuwise.launch.ray_nodes import RESERVE_TIMEOUT_S, bundle_of

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 1.0


def _term_with_parent() -> None:
    """In the server's process, before exec: TERM when the Ray worker that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Replica:
    """One replica's `gpuwise serve`. Stopped by a method call, not by `ray.cancel`: a task's cancel is a
    KeyboardInterrupt raised through SIGINT's handler, and a cluster started in the background (`nohup ray start`,
    `ray start ... &` in a script) hands its workers SIGINT ignored, so the cancel never arrives."""

    def __init__(self, serve: list[str], announce: str):
        env = dict(os.environ, GPUWISE_ANNOUNCE_HOST=ray.util.get_node_ip_address())
        # Ray sets OMP_NUM_THREADS to the actor's CPUs; serve's own rule (plan/serving.py: compute_threads)
        # decides, and serve --threads overrides it.
        env.pop("OMP_NUM_THREADS", None)
        env.pop("GPUWISE_API_KEY", None)  # the key file decides
        cmd = [sys.executable, "-m", "gpuwise", *serve, "--announce", announce]
        # A session of its own: a signal Ray sends the worker's group is not the server's; the actor decides.
        self.proc = subprocess.Popen(cmd, env=env, preexec_fn=_term_with_parent, start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> int:
        """TERM, and wait while the server drains (uvicorn's graceful shutdown, `serve --grace`)."""
        self.proc.send_signal(signal.SIGTERM)  # a no-op once it has exited
        return self.proc.wait()


def _exit(rc: int) -> str:
    """A server's end in words: uvicorn, once drained, ends by its signal's own default (-15: SIGTERM)."""
    return signal.Signals(-rc).name if rc < 0 else f"exit code {rc}"


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
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # `ray job stop`
    bundle = bundle_of(args.cpus, args.gpus, args.accelerator_type)
    group = placement_group([bundle] * args.replicas, strategy="SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        print(f"gpuwise: the cluster could not reserve {args.replicas} x {bundle} in {RESERVE_TIMEOUT_S} s",
              file=sys.stderr)  # fmt: skip
        return 1
    plain = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    actor: Any = ray.remote(Replica)  # Ray's stubs type neither an actor class's options nor its handles' methods
    replicas = {
        i: actor.options(
            num_cpus=args.cpus,
            num_gpus=args.gpus,
            resources=plain,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            max_restarts=0,  # a server that died is reported, not started again behind the record's back
        ).remote(serve, os.path.join(args.run_dir, f"replica-{i}.json"))
        for i in range(args.replicas)
    }
    codes: dict[int, int] = {}
    while len(codes) < len(replicas) and not stopping.wait(POLL_S):
        for i, replica in replicas.items():
            if i in codes:
                continue
            try:
                rc = ray.get(replica.poll.remote())
            except RayActorError as e:  # its node or worker died: the server went with it (PR_SET_PDEATHSIG)
                print(f"gpuwise: replica {i} is lost: {str(e).splitlines()[0]}", file=sys.stderr)
                rc = 1
            if rc is not None:
                print(f"gpuwise: replica {i}'s server exited ({_exit(rc)})", file=sys.stderr)
                codes[i] = rc
    if stopping.is_set():
        running = {i: r for i, r in replicas.items() if i not in codes}
        print(f"gpuwise: stopping: TERM to {len(running)} replica(s), each draining for up to {DRAIN_S} s",
              file=sys.stderr)  # fmt: skip
        stops = {i: r.stop.remote() for i, r in running.items()}
        ready, _ = ray.wait(list(stops.values()), num_returns=len(stops), timeout=DRAIN_S + 10)
        for i, ref in stops.items():
            try:
                print(f"gpuwise: replica {i} stopped ({_exit(ray.get(ref, timeout=0))})", file=sys.stderr)
            except (GetTimeoutError, RayActorError) as e:
                print(f"gpuwise: replica {i} did not stop in {DRAIN_S + 10} s: {type(e).__name__}", file=sys.stderr)
        return 0
    return next((1 if rc < 0 else rc for rc in codes.values() if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
