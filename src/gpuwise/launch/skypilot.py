"""SkyPilot: a task YAML for `sky launch` (a cluster of its own, stopped when idle) or, with --managed,
`sky jobs launch` (a managed job, recovered after a preemption, spot instances allowed).

The resources list the plan's best accelerators as `ordered`: SkyPilot tries them in gpuwise's order, the
cheapest whole job first. Under `any_of` its optimizer would rank them itself, by the hourly price of a
job it assumes lasts one hour; gpuwise knows the job's length, and so its whole cost.
"""

from __future__ import annotations

import re
from pathlib import Path

import gpuwise
from gpuwise import __version__
from gpuwise.errors import GpuwiseError
from gpuwise.launch.endpoint import PORT, PROBE_PATHS, Endpoint
from gpuwise.launch.engines import SKY_NAME, STATE_TIMEOUT_S, Engine, Options, dump_yaml, record_server, run_client
from gpuwise.launch.job import Job

MOUNT = "/gpuwise-runs"  # where the bucket holding the run directories is mounted on every node
INPUTS = "/gpuwise-inputs"  # where the local files the train command names are copied on every node
LOCAL_PATHS = ("--data", "--init-from", "--base")  # train options that may name a file or folder here
PROVISION_TIMEOUT_S = 1800  # finding and starting the nodes (and a managed job's controller) before it runs
RECOVERY_RESTARTS = 3  # a managed job restarted after this many failures of its own (not preemptions) stops


def node_run_dir(job: Job) -> str:
    return f"{MOUNT}/{Path(job.run_dir).name}"


def carried(job: Job) -> tuple[Job, dict[str, str]]:
    """The job with each local file or folder its train command names (--data, --init-from, a --base
    directory) moved to where SkyPilot copies it on the nodes, and those copies (node path -> local path)."""
    from dataclasses import replace

    args, mounts = list(job.train_args), dict[str, str]()
    for i, arg in enumerate(args[:-1]):
        if arg in LOCAL_PATHS and Path(args[i + 1]).exists():
            local = Path(args[i + 1]).resolve()
            there = f"{INPUTS}/{len(mounts)}-{local.name}"
            mounts[there] = str(local)
            args[i + 1] = there
    return replace(job, train_args=tuple(args)), mounts


def source_tree() -> Path | None:
    """The checkout gpuwise runs from, when it is installed from one (pip install -e): SkyPilot syncs it to
    every node as the task's workdir."""
    root = Path(gpuwise.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "gpuwise").is_dir() else None


def default_setup() -> str:
    where = "-e ." if source_tree() else f'"gpuwise=={__version__}"'
    return f'pip install "torch==2.13.0" && pip install {where}'


class SkyPilot(Engine):
    name, suffix, client = "skypilot", ".sky.yaml", "sky"
    install = "pip install skypilot (in a venv of its own: it pins click and uvicorn), then `sky check`"
    names, title = SKY_NAME, "SkyPilot"
    name_hint = "pass --gpu with one SkyPilot names (`sky show-gpus`)"

    def check(self, job: Job, opts: Options) -> None:
        if job.accelerator != "cuda":
            raise GpuwiseError("SkyPilot rents GPU nodes: give --gpu (a CPU job runs here, or on Slurm, Ray, k8s)")
        super().check(job, opts)
        if opts.managed and not opts.bucket:
            raise GpuwiseError(
                "a managed job outlives its nodes: give --bucket NAME for the run directory, or it is lost with "
                "them on a preemption"
            )
        if job.choice.nodes > 1 and not opts.bucket:
            raise GpuwiseError(
                f"{job.choice.nodes} nodes need one run directory they all see: give --bucket NAME (each VM's own "
                "disk would hold a part of it)"
            )

    def task(self, job: Job, opts: Options) -> dict:
        choices = (job.choice, *job.alternatives)
        accelerators = [{"accelerators": f"{SKY_NAME[c.gpu]}:{c.per_node}"} for c in choices]
        # Two slugs may share a SkyPilot name (H100 SXM and PCIe): keep the first, in gpuwise's order.
        accelerators = [a for i, a in enumerate(accelerators) if a not in accelerators[:i]]
        resources: dict = {"ordered": accelerators} if len(accelerators) > 1 else dict(accelerators[0])
        resources["use_spot"] = opts.spot
        resources["disk_size"] = 256
        if opts.managed:
            resources["job_recovery"] = {"strategy": "FAILOVER", "max_restarts_on_errors": RECOVERY_RESTARTS}
        else:
            resources["autostop"] = opts.autostop_min  # idle minutes before the cluster stops (and stops billing)
        # Without a bucket the run stays on the VM, in the task's working directory (`sky rsync-down` fetches it).
        run_dir = node_run_dir(job) if opts.bucket else f"gpuwise-runs/{Path(job.run_dir).name}"
        moved, inputs = carried(job.moved(run_dir))
        task: dict = {
            "name": job.name,
            "num_nodes": job.choice.nodes,
            "resources": resources,
            "envs": {"GPUWISE_RUN_DIR": run_dir},
        }
        if record_server():  # the team's record: its URL given at launch by --secret GPUWISE_DB, from the environment
            task["secrets"] = {"GPUWISE_DB": None}
        tree = source_tree()
        if tree is not None:
            task["workdir"] = str(tree)
        mounts: dict = dict(inputs)  # SkyPilot copies each local path to its place on every node
        if opts.bucket:
            # MOUNT_CACHED: checkpoints are written locally and uploaded; a plain FUSE mount cannot rename them.
            mounts[MOUNT] = {"name": opts.bucket, "mode": "MOUNT_CACHED"}
        if mounts:
            task["file_mounts"] = mounts
        task["setup"] = opts.setup or default_setup()
        head = '$(echo "$SKYPILOT_NODE_IPS" | head -n1)'
        task["run"] = moved.node_script(
            opts.python, "$SKYPILOT_NODE_RANK", head, "$SKYPILOT_TASK_ID", "$SKYPILOT_NUM_NODES"
        ).replace(f"--nproc-per-node={job.choice.per_node}", "--nproc-per-node=$SKYPILOT_NUM_GPUS_PER_NODE")
        return task

    def render(self, job: Job, opts: Options) -> str:
        head = (
            f"# {job.headline()}\n# {'sky jobs launch' if opts.managed else 'sky launch'} this file; the "
            "accelerators are tried in order, the cheapest whole job first\n"
        )
        return head + dump_yaml([self.task(job, opts)])

    def submit(self, artifact: Path, job: Job, opts: Options) -> str:
        sky = self.need_client()
        secret = ["--secret", "GPUWISE_DB"] if record_server() else []  # its value: this shell's GPUWISE_DB
        if opts.managed:
            # -d: return once the job is submitted (the logs would stream until it ends)
            run_client([sky, "jobs", "launch", "-d", "-y", "-n", job.name, str(artifact), *secret],
                       "sky jobs launch", timeout=PROVISION_TIMEOUT_S)  # fmt: skip
        else:
            run_client([sky, "launch", "-d", "-y", "-c", job.name, str(artifact), *secret], "sky launch",
                       timeout=PROVISION_TIMEOUT_S)  # fmt: skip
        return job.name

    # --- an endpoint: a SkyServe service (`sky serve up`), its replicas behind SkyPilot's load balancer -------

    def check_endpoint(self, ep: Endpoint, opts: Options) -> None:
        if ep.accelerator != "cuda":
            raise GpuwiseError("SkyPilot rents GPU nodes: give --gpu (a CPU endpoint runs on Slurm, Ray or k8s)")
        super().check_endpoint(ep, opts)

    def service(self, ep: Endpoint, opts: Options) -> dict:
        port = opts.port or PORT
        policy: dict = {"min_replicas": ep.replicas}
        if ep.max_replicas > ep.replicas:
            policy["max_replicas"] = ep.max_replicas
            # SkyServe adds a replica when the requests a replica gets exceed what the plan says it holds
            # at the targets (its goodput), and removes one below it.
            if ep.figures.get("goodput_per_replica"):
                policy["target_qps_per_replica"] = round(float(ep.figures["goodput_per_replica"]), 4)
        task: dict = {
            "name": ep.name,
            "service": {
                # no key needed: serve/app.py answers the probe paths before the key check
                "readiness_probe": {"path": PROBE_PATHS["ready"], "initial_delay_seconds": PROVISION_TIMEOUT_S},
                "replica_policy": policy,
            },
            "resources": {"accelerators": f"{SKY_NAME[ep.gpu]}:{ep.gpus}", "ports": port, "disk_size": 256,
                          "use_spot": opts.spot},  # fmt: skip
            # the key's value is given at `sky serve up --secret GPUWISE_API_KEY`, from the environment
            "secrets": {"GPUWISE_API_KEY": None} | ({"GPUWISE_DB": None} if record_server() else {}),
        }
        tree = source_tree()
        if tree is not None:
            task["workdir"] = str(tree)
        task["setup"] = opts.setup or default_setup()
        import shlex

        task["run"] = shlex.join([opts.python, "-m", "gpuwise", *ep.serve_command(host="0.0.0.0", port=port)])
        return task

    def render_endpoint(self, ep: Endpoint, opts: Options) -> str:
        head = (f"# {ep.headline()}\n# GPUWISE_API_KEY=... sky serve up -n {ep.name} this-file --secret "
                "GPUWISE_API_KEY\n")  # fmt: skip
        return head + dump_yaml([self.service(ep, opts)])

    def submit_endpoint(self, artifact: Path, ep: Endpoint, opts: Options) -> str:
        import os

        sky = self.need_client()
        key = Path(ep.key_file).read_text().splitlines()[0] if ep.key_file else ""
        run_client([sky, "serve", "up", "-y", "-n", ep.name, str(artifact), "--secret", "GPUWISE_API_KEY",
                    *(["--secret", "GPUWISE_DB"] if record_server() else [])],
                   "sky serve up", timeout=PROVISION_TIMEOUT_S, env=dict(os.environ, GPUWISE_API_KEY=key))  # fmt: skip
        return ep.name

    def stop(self, job_id: str, data: dict) -> str:
        sky = self.need_client()
        if data.get("endpoint"):
            run_client([sky, "serve", "down", "-y", job_id], "sky serve down", timeout=PROVISION_TIMEOUT_S)
            return f"sky serve down {job_id}"
        if data.get("managed"):
            run_client([sky, "jobs", "cancel", "-y", "-n", job_id], "sky jobs cancel", timeout=PROVISION_TIMEOUT_S)
            return f"sky jobs cancel -n {job_id}"
        run_client([sky, "down", "-y", job_id], "sky down", timeout=PROVISION_TIMEOUT_S)
        return f"sky down {job_id}"

    def state(self, job_id: str, data: dict) -> str:
        sky = self.need_client()
        if data.get("endpoint"):
            out = run_client([sky, "serve", "status", job_id], "sky serve status", timeout=STATE_TIMEOUT_S)
            found = re.search(r"\b(CONTROLLER_INIT|REPLICA_INIT|NO_REPLICA|READY|SHUTTING_DOWN|FAILED\w*)\b", out)
            return found.group(1) if found else "UNKNOWN"
        if data.get("managed"):
            out = run_client([sky, "jobs", "queue"], "sky jobs queue", timeout=STATE_TIMEOUT_S)
        else:
            out = run_client([sky, "queue", job_id], "sky queue", timeout=STATE_TIMEOUT_S)
        for line in out.splitlines():
            if job_id in line or not data.get("managed"):
                found = re.search(r"\b(PENDING|STARTING|RUNNING|RECOVERING|SUCCEEDED|FAILED\w*|CANCELL\w+)\b", line)
                if found:
                    return found.group(1)
        return "UNKNOWN"

