"""The driver of a gpuwise Ray job (`gpuwise launch ray`), run by Ray on the cluster:

    python -m gpuwise.launch.ray_nodes --nodes N --per-node P --cpus C [--gpus G --accelerator-type NAME]
        --threads T --job-id ID [--port P] -- train WORKLOAD ... --run-dir RUN

One placement-group bundle per node, on distinct nodes (STRICT_SPREAD), holds that node's GPUs and CPUs;
a task in each runs the node's torchrun, with the rendezvous on the first bundle's node. Ray places and
reserves; torchrun starts the processes, as under Slurm, SkyPilot and Kubernetes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gpuwise.launch.job import node_script

RESERVE_TIMEOUT_S = 600  # a cluster that cannot hold the bundles in this time will not: say so and stop


def bundle_of(cpus: int, gpus: int, accelerator_type: str | None) -> dict[str, float]:
    """What one node of the job holds: its CPUs, its GPUs, and Ray's label for their model."""
    bundle: dict[str, float] = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    if accelerator_type:
        bundle[f"accelerator_type:{accelerator_type}"] = 0.001  # Ray sets this resource on nodes of that GPU
    return bundle


@ray.remote(num_cpus=0)
def node_address() -> str:
    return ray.util.get_node_ip_address()


@ray.remote
def run_node(script: str, rank: int, head: str, threads: int) -> int:
    env = dict(os.environ, GPUWISE_NODE_RANK=str(rank), GPUWISE_HEAD=head, OMP_NUM_THREADS=str(threads))
    return subprocess.run(["bash", "-c", script], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuwise.launch.ray_nodes")
    for flag in ("--nodes", "--per-node", "--cpus", "--threads"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--gpus", type=int, default=0)
    p.add_argument("--accelerator-type")
    p.add_argument("--job-id", required=True)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("train", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    ray.init()
    bundle = bundle_of(args.cpus, args.gpus, args.accelerator_type)
    group = placement_group([bundle] * args.nodes, strategy="STRICT_SPREAD" if args.nodes > 1 else "PACK")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        print(f"gpuwise: the cluster could not reserve {args.nodes} nodes of {bundle} in {RESERVE_TIMEOUT_S} s",
              file=sys.stderr)  # fmt: skip
        return 1
    at = lambda i: PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)  # noqa: E731
    head = ray.get(node_address.options(scheduling_strategy=at(0)).remote())
    # sys.executable: the cluster's Python, the one running this driver, runs torchrun on every node
    script = node_script(train, args.nodes, args.per_node, sys.executable, "$GPUWISE_NODE_RANK", "$GPUWISE_HEAD",
                         args.job_id, port=args.port, threads=args.threads)  # fmt: skip
    plain = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    runs = [
        run_node.options(num_cpus=args.cpus, num_gpus=args.gpus, resources=plain, scheduling_strategy=at(i)).remote(
            script, i, head, args.threads
        )
        for i in range(args.nodes)
    ]
    codes = ray.get(runs)
    # A node killed by a signal returns a negative code: any non-zero one fails the job.
    return next((1 if rc < 0 else rc for rc in codes if rc), 0)


if __name__ == "__main__":
    sys.exit(main())
