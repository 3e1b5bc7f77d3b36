"""The driver of a gpuwise Ray job (`gpuwise launch ray`), run by Ray on the cluster.

One placement-group bundle per node, on distinct nodes (STRICT_SPREAD), holds that node's GPUs and CPUs;
a task in each runs the node's torchrun, with the rendezvous on the first bundle's node. Ray places and
reserves; torchrun starts the processes, as under Slurm, SkyPilot and Kubernetes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

RESERVE_TIMEOUT_S = 600  # a cluster that cannot hold the bundles in this time will not: say so and stop


@ray.remote(num_cpus=0)
def node_address() -> str:
    return ray.util.get_node_ip_address()


@ray.remote
def run_node(script: str, rank: int, head: str, threads: int) -> int:
    env = dict(os.environ, GPUWISE_PYTHON=sys.executable, GPUWISE_NODE_RANK=str(rank), GPUWISE_HEAD=head,
               OMP_NUM_THREADS=str(threads))  # fmt: skip
    return subprocess.run(["bash", "-c", script], env=env).returncode


def main() -> int:
    spec = json.loads(os.environ["GPUWISE_RAY_NODES"])
    ray.init()
    nodes, bundle = spec["nodes"], spec["bundle"]
    group = placement_group([bundle] * nodes, strategy="STRICT_SPREAD" if nodes > 1 else "PACK")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        print(f"gpuwise: the cluster could not reserve {nodes} nodes of {bundle} in {RESERVE_TIMEOUT_S} s",
              file=sys.stderr)  # fmt: skip
        return 1
    at = lambda i: PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)  # noqa: E731
    head = ray.get(node_address.options(scheduling_strategy=at(0)).remote())
    gpus = bundle.get("GPU", 0)
    plain = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    runs = [
        run_node.options(num_cpus=bundle["CPU"], num_gpus=gpus, resources=plain, scheduling_strategy=at(i)).remote(
            spec["script"], i, head, spec["threads"]
        )
        for i in range(nodes)
    ]
    codes = ray.get(runs)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
