"""Ray: a Ray job on an existing cluster, submitted through Ray's Jobs API.

The job's driver (`gpuwise.launch.ray_nodes`) reserves one placement-group bundle per node (the node's
GPUs and CPUs, spread over distinct nodes) and runs one torchrun in each, as on every other engine. The
runtime_env carries gpuwise's code (py_modules); the data paths in the train command must be readable
on the cluster's nodes.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import gpuwise
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.launch.endpoint import DRAIN_S, Endpoint
from gpuwise.launch.engines import RAY_NAME, STATE_TIMEOUT_S, Engine, Options, record_env
from gpuwise.launch.job import Job
from gpuwise.runs import db

AGENT_WAIT_S = 60
DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # `ray start --head`'s dashboard, where the Jobs API answers


def fleet_metadata(gpu: str, gpus: int, cpus: int) -> dict[str, str]:
    """What `gpuwise fleet` reads of a Ray job gpuwise launched: its devices, and who launched it for which team
    (Ray's Jobs API keeps no user)."""
    who = db.whoami()
    return {"gpuwise_gpu": gpu, "gpuwise_gpus": str(gpus), "gpuwise_cpus": str(cpus),
            "gpuwise_user": who["user"] or "", "gpuwise_team": who["team"] or ""}  # fmt: skip


def address_of(opts: Options) -> str:
    return opts.address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def _client(address: str):
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise GpuwiseError(
            "--submit needs Ray's Jobs client: pip install 'ray[default]' (in gpuwise's environment)"
        ) from None
    from ray.exceptions import AuthenticationError

    try:
        return JobSubmissionClient(address)
    except AuthenticationError as e:  # Ray's own message is a paragraph; what it said and the way in, in one line
        raise GpuwiseError(
            f"the Ray cluster at {address} refused gpuwise: {first_line(e)} (its token authentication: set "
            "RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)"
        ) from None
    except Exception as e:  # noqa: BLE001 - no cluster there: Ray's ConnectionError, as one line
        raise GpuwiseError(
            f"no Ray cluster answers at {address}: {first_line(e)} (start one: ray start --head)"
        ) from None


def _reachable(address: str) -> None:
    """Ray's client retries an unreachable address for minutes; `gpuwise runs` asks with a short timeout first."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        socket.create_connection((url.hostname or "127.0.0.1", url.port or 8265), timeout=STATE_TIMEOUT_S).close()
    except OSError as e:
        raise GpuwiseError(f"no Ray cluster answers at {address} ({e.strerror or e})") from None


class Ray(Engine):
    name, suffix, client = "ray", ".ray-job.json", "ray"
    install = "pip install 'ray[default]'"
    names, title = RAY_NAME, "Ray"
    name_hint = "its nodes carry no accelerator_type resource for it (ray.util.accelerators)"

    def spec(self, job: Job, opts: Options) -> dict[str, Any]:
        """The job as `JobSubmissionClient.submit_job` takes it (and `ray job submit` with these fields)."""
        c = job.choice
        layout = ["--nodes", str(c.nodes), "--per-node", str(c.per_node), "--cpus", str(job.cpus_per_node),
                  "--threads", str(job.threads), "--job-id", job.name, "--port", str(job.rdzv_port)]  # fmt: skip
        if job.accelerator == "cuda":
            layout += ["--gpus", str(c.per_node), "--accelerator-type", RAY_NAME[c.gpu]]
        return {
            "submission_id": job.name,
            "entrypoint": shlex.join([opts.python, "-m", "gpuwise.launch.ray_nodes", *layout, "--",
                                      *job.train_command()]),  # fmt: skip
            "runtime_env": {"py_modules": [str(Path(gpuwise.__file__).parent)]},
            "entrypoint_num_cpus": 0,  # the driver only waits; the bundles hold the resources
            "metadata": {"gpuwise_workload": job.workload, "gpuwise_run_dir": job.run_dir, **fleet_metadata(
                job.choice.gpu if job.accelerator == "cuda" else "cpu", c.gpus if job.accelerator == "cuda" else 0,
                job.cpus_per_node * c.nodes)},
        }

    def render(self, job: Job, opts: Options) -> str:
        return json.dumps(self.spec(job, opts), indent=2) + "\n"

    def preflight(self, job: Job, opts: Options) -> None:
        address = address_of(opts)
        _client(address)
        self._check_cluster(address, job)

    def submit(self, artifact: Path, job: Job, opts: Options) -> str:
        Path(job.run_dir).parent.mkdir(parents=True, exist_ok=True)
        return self._submit(json.loads(artifact.read_text()), opts)

    def _submit(self, spec: dict, opts: Options) -> str:
        # The team's record reaches the job through its runtime_env at submit time, not the artifact.
        env = spec.get("runtime_env", {}).get("env_vars", {}) | record_env()
        spec = spec | {"runtime_env": spec.get("runtime_env", {}) | ({"env_vars": env} if env else {})}
        client = _client(address_of(opts))
        deadline = time.monotonic() + AGENT_WAIT_S
        while True:
            try:
                return str(client.submit_job(**spec))
            except Exception as e:  # noqa: BLE001 - the Jobs API's refusal (a duplicate id, a bad runtime_env)
                # A cluster just started has no job agent for a few seconds, and says to try again.
                if "No available agent" in str(e) and time.monotonic() < deadline:
                    time.sleep(1)
                    continue
                raise GpuwiseError(f"Ray refused the job: {first_line(e)}") from None

    def _check_cluster(self, address: str, job: Job) -> None:
        """A node shape the cluster does not have would leave the job pending for ever: refuse it now."""
        from ray.util.state import list_nodes

        try:
            alive = [n for n in list_nodes(address=address, timeout=STATE_TIMEOUT_S, detail=True) if n.state == "ALIVE"]
        except Exception as e:  # noqa: BLE001
            raise GpuwiseError(f"cannot list the Ray cluster's nodes at {address}: {first_line(e)}") from None
        # ray, which only a Ray job's driver needs
        from gpuwise.launch.ray_nodes import bundle_of

        c = job.choice
        want = bundle_of(job.cpus_per_node, c.per_node if job.accelerator == "cuda" else 0,
                         RAY_NAME.get(c.gpu) if job.accelerator == "cuda" else None)  # fmt: skip
        fit = [n for n in alive if all((n.resources_total or {}).get(k, 0) >= v for k, v in want.items())]
        if len(fit) < job.choice.nodes:
            shown = ", ".join(str({k: v for k, v in (n.resources_total or {}).items() if k in want}) for n in alive)
            raise GpuwiseError(
                f"the Ray cluster at {address} has {len(fit)} of the {job.choice.nodes} nodes the job needs, each "
                f"with {want} (its nodes: {shown or 'none alive'}); pass --gpus/--nodes/--cpus-per-node that fit"
            )

    # --- an endpoint: a job whose driver (gpuwise.launch.ray_serve) runs one `gpuwise serve` per replica ------

    def endpoint_spec(self, ep: Endpoint, opts: Options) -> dict[str, Any]:
        layout = ["--replicas", str(ep.replicas), "--cpus", str(ep.cpus), "--run-dir", ep.run_dir]
        if ep.accelerator == "cuda":
            layout += ["--gpus", str(ep.gpus), "--accelerator-type", RAY_NAME[ep.gpu]]
        return {
            "submission_id": ep.name,
            "entrypoint": shlex.join([opts.python, "-m", "gpuwise.launch.ray_serve", *layout, "--",
                                      *ep.serve_command(host="0.0.0.0", port=opts.port)]),  # fmt: skip
            # RAY_JOB_STOP_WAIT_TIME_S: how long `ray job stop` lets the driver have its servers drain before it
            # kills the job (Ray's default, 3 s, would cut streams mid-answer)
            "runtime_env": {"py_modules": [str(Path(gpuwise.__file__).parent)],
                            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(DRAIN_S + 15)}},  # fmt: skip
            "entrypoint_num_cpus": 0,
            "metadata": {"gpuwise_endpoint": ep.model, "gpuwise_workload": ep.model, "gpuwise_run_dir": ep.run_dir,
                         **fleet_metadata(ep.gpu, ep.gpus * ep.replicas, ep.cpus * ep.replicas)},
        }

    def render_endpoint(self, ep: Endpoint, opts: Options) -> str:
        return json.dumps(self.endpoint_spec(ep, opts), indent=2) + "\n"

    def preflight_endpoint(self, ep: Endpoint, opts: Options) -> None:
        address = address_of(opts)
        _client(address)
        from ray.util.state import list_nodes

        # ray, which only a Ray job's driver needs
        from gpuwise.launch.ray_nodes import bundle_of

        try:
            alive = [n for n in list_nodes(address=address, timeout=STATE_TIMEOUT_S, detail=True) if n.state == "ALIVE"]
        except Exception as e:  # noqa: BLE001
            raise GpuwiseError(f"cannot list the Ray cluster's nodes at {address}: {first_line(e)}") from None
        want = bundle_of(ep.cpus, ep.gpus, RAY_NAME.get(ep.gpu) if ep.accelerator == "cuda" else None)
        fit = sum(min(int((n.resources_total or {}).get(k, 0) // v) for k, v in want.items() if v >= 1) for n in alive)
        if fit < ep.replicas:
            raise GpuwiseError(
                f"the Ray cluster at {address} holds {fit} of the {ep.replicas} replicas of {want} the endpoint needs; "
                "pass --replicas/--gpus/--cpus-per-node that fit"
            )

    def submit_endpoint(self, artifact: Path, ep: Endpoint, opts: Options) -> str:
        Path(ep.run_dir).mkdir(parents=True, exist_ok=True)
        return self._submit(json.loads(artifact.read_text()), opts)

    def stop(self, job_id: str, data: dict) -> str:
        address = data.get("address") or DEFAULT_ADDRESS
        _reachable(address)
        try:
            _client(address).stop_job(job_id)
        except Exception as e:  # noqa: BLE001
            raise GpuwiseError(f"Ray: {first_line(e)}") from None
        return f"ray job stop {job_id}: the driver ends; each server gets TERM and drains its in-flight requests"

    def state(self, job_id: str, data: dict) -> str:
        address = data.get("address") or DEFAULT_ADDRESS
        _reachable(address)
        client = _client(address)
        try:
            return str(client.get_job_status(job_id).value)
        except Exception as e:  # noqa: BLE001
            raise GpuwiseError(f"Ray: {first_line(e)}") from None
