"""What every engine shares: its options, the contract each one implements, and the names of accelerators
in each engine's own terms.

gpuwise writes no scheduler: an engine here only renders its engine's own artifact from a `Job` (an sbatch
script, a Ray job, a SkyPilot task, Kubernetes manifests) and hands it to that engine's own client.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.launch.endpoint import Endpoint
from gpuwise.launch.job import Job
from gpuwise.runs import db

CLIENT_TIMEOUT_S = 120  # one call of an engine's client (sbatch, kubectl apply, ...)
STATE_TIMEOUT_S = 15  # asking a job's state for `gpuwise runs`: a slow engine must not hang the listing


@dataclass(frozen=True)
class Options:
    """The engine-specific options of `gpuwise launch`; each engine reads its own."""

    python: str = "python3"  # the Python that runs gpuwise on the nodes
    partition: str | None = None  # Slurm
    account: str | None = None
    qos: str | None = None
    gres_type: str | None = None  # Slurm: the site's GPU type name in --gpus-per-node=TYPE:N
    address: str | None = None  # Ray: the cluster (else RAY_ADDRESS)
    managed: bool = False  # SkyPilot: a managed job (sky jobs launch), recovered after preemption
    spot: bool = False
    bucket: str | None = None  # SkyPilot: the bucket the run directory lives in
    autostop_min: int = 10
    setup: str | None = None  # SkyPilot: the command that installs gpuwise on each node
    image: str | None = None  # Kubernetes: the container image with gpuwise installed
    namespace: str | None = None
    pvc: str | None = None  # Kubernetes: an existing claim for the run directory (else one is created)
    pvc_size_gib: int = 100
    storage_class: str | None = None
    key_secret: str | None = None  # Kubernetes: an existing Secret holding the endpoint's key (key "api-key")
    port: int = 0  # an endpoint's port: on Slurm and Ray 0 (any free one, announced); on k8s, SkyPilot 8000
    time_limit_s: int | None = None  # an endpoint's time limit where the engine has one (Slurm) [the partition's]


class Engine(ABC):
    name: str
    suffix: str  # of the artifact's file
    client: str  # the program --submit runs
    install: str  # how to get it, for the refusal when it is missing
    names: dict[str, str] | None = None  # catalog slug -> the engine's name for it; None: any GPU (Slurm)
    title = ""  # the engine's name in messages
    name_hint = ""  # what to do when it cannot name a GPU

    def check(self, job: Job, opts: Options) -> None:
        """Refuse, before anything is written or submitted, a job this engine cannot run as planned."""
        if self.names is not None and job.accelerator == "cuda":
            engine_name(self.names, job.choice.gpu, job.choice.name, self.title, self.name_hint)

    def preflight(self, job: Job, opts: Options) -> None:
        """Before --submit writes anything: the engine's client is here, and the engine can run the job."""
        self.need_client()

    @abstractmethod
    def render(self, job: Job, opts: Options) -> str: ...

    @abstractmethod
    def submit(self, artifact: Path, job: Job, opts: Options) -> str:
        """Hand the artifact to the engine; the job's id there."""

    @abstractmethod
    def state(self, job_id: str, data: dict) -> str:
        """The job's state as the engine names it (PENDING, RUNNING, COMPLETED, FAILED, ...)."""

    # An endpoint (`gpuwise launch ENGINE -- serve MODEL`): each engine renders, submits and stops its own.
    def check_endpoint(self, ep: Endpoint, opts: Options) -> None:
        if self.names is not None and ep.accelerator == "cuda":
            engine_name(self.names, ep.gpu, ep.gpu_name, self.title, self.name_hint)

    def preflight_endpoint(self, ep: Endpoint, opts: Options) -> None:
        self.need_client()

    def render_endpoint(self, ep: Endpoint, opts: Options) -> str:
        raise GpuwiseError(f"{self.name} cannot run an endpoint yet")

    def submit_endpoint(self, artifact: Path, ep: Endpoint, opts: Options) -> str:
        raise GpuwiseError(f"{self.name} cannot run an endpoint yet")

    @abstractmethod
    def stop(self, job_id: str, data: dict) -> str:
        """End the job (an endpoint drains its in-flight requests first); what the engine said."""

    def need_client(self) -> str:
        found = shutil.which(self.client)
        if found is None:
            raise GpuwiseError(f"--submit needs {self.name}'s client `{self.client}` (not on PATH): {self.install}")
        return found


def run_client(argv: list[str], what: str, timeout: float = CLIENT_TIMEOUT_S, **kw) -> str:
    """Run an engine's client; its refusal (stderr) as one line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise GpuwiseError(f"{what}: `{argv[0]}` gave no answer in {timeout:.0f} s") from None
    except OSError as e:
        raise GpuwiseError(f"{what}: cannot run `{argv[0]}`: {e.strerror}") from None
    if done.returncode != 0:
        text = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
        said = text.splitlines()[-1][:300]  # clients end with the line that says why
        raise GpuwiseError(f"{what}: {said}")
    return done.stdout


# The team's record (runs/db.py), as this shell names it: a launched job writes its run, plan and measured
# figures there from the node where it runs. The address goes by each engine's own way for secrets or the
# environment at submit time, never into an artifact: Slurm passes the submitting environment (sbatch's
# default), Ray's runtime_env env_vars, a Kubernetes Secret, SkyPilot's --secret.
RECORD_VARS = ("GPUWISE_DB", "PGPASSFILE", "PGSERVICEFILE", "PGSERVICE")  # libpq's own files: paths, no secret
RECORD_SECRET = "gpuwise-record"  # Kubernetes: the Secret holding the record's URL, key "url"
RECORD_ROUTE = {  # how each engine hands it over, as the launch's printout says
    "slurm": "sbatch passes this shell's environment on",
    "ray": "in the job's runtime_env, given at submit",
    "k8s": f"from the Secret {RECORD_SECRET}, made at --submit",
    "skypilot": "by sky's --secret GPUWISE_DB",
}


def record_env() -> dict[str, str]:
    """GPUWISE_DB and libpq's variables, where this shell sets them."""
    return {k: os.environ[k] for k in RECORD_VARS if os.environ.get(k)}


def record_note(engine: str) -> str | None:
    """Where a submitted job records its run, for the launch's printout; None for the user's own default."""
    if not os.environ.get("GPUWISE_DB"):
        return None
    if engine in ("k8s", "skypilot") and not record_server():
        return f"the job records its run in its own node's record ({db.where()} is a file on this machine)"
    return f"the job records its run in {db.where()} ({RECORD_ROUTE[engine]})"


def record_server() -> str | None:
    """The record's URL when it is a server every node can reach (a file is one machine's: a job elsewhere
    keeps its own node's record)."""
    url = os.environ.get("GPUWISE_DB") or ""
    return url if "://" in url and not url.startswith("sqlite") else None


def k8s_record_secret(kubectl: list[str]) -> None:
    """The Secret gpuwise-record from GPUWISE_DB, made or replaced: its value goes through a file only this
    user reads, never a command line (kubectl create --dry-run renders it, apply stores it)."""
    url = record_server()
    if url is None:
        return
    with tempfile.TemporaryDirectory(prefix="gpuwise-record-") as tmp:
        path = os.path.join(tmp, "url")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(url)
        manifest = run_client([*kubectl, "create", "secret", "generic", RECORD_SECRET, f"--from-file=url={path}",
                               "--dry-run=client", "-o", "yaml"], "kubectl create secret")  # fmt: skip
    run_client([*kubectl, "apply", "-f", "-"], "kubectl apply (the record's Secret)", input=manifest)


RECORD_ENV_K8S = [  # the container's GPUWISE_DB, from the Secret when there is one (optional: else its own)
    {"name": "GPUWISE_DB",
     "valueFrom": {"secretKeyRef": {"name": RECORD_SECRET, "key": "url", "optional": True}}},  # fmt: skip
]


# Kubernetes: the value NVIDIA's GPU Feature Discovery gives the node label nvidia.com/gpu.product (the
# product name nvidia-smi prints, spaces as '-'). SkyPilot and Ray: the names their own catalogs use
# (sky's accelerator registry; ray.util.accelerators).
K8S_PRODUCT = {
    "t4": "Tesla-T4",
    "l4": "NVIDIA-L4",
    "a10": "NVIDIA-A10",
    "a10g": "NVIDIA-A10G",
    "l40s": "NVIDIA-L40S",
    "a100-40gb": "NVIDIA-A100-SXM4-40GB",
    "a100-80gb": "NVIDIA-A100-SXM4-80GB",
    "h100-sxm": "NVIDIA-H100-80GB-HBM3",
    "h100-pcie": "NVIDIA-H100-PCIe",
    "h100-nvl": "NVIDIA-H100-NVL",
    "h200": "NVIDIA-H200",
    "b200": "NVIDIA-B200",
    "rtx-3090": "NVIDIA-GeForce-RTX-3090",
    "rtx-4090": "NVIDIA-GeForce-RTX-4090",
    "rtx-5090": "NVIDIA-GeForce-RTX-5090",
    "rtx-a6000": "NVIDIA-RTX-A6000",
}
SKY_NAME = {
    "t4": "T4",
    "l4": "L4",
    "a10": "A10",
    "a10g": "A10G",
    "l40s": "L40S",
    "a100-40gb": "A100",
    "a100-80gb": "A100-80GB",
    "h100-sxm": "H100",  # the clouds' H100 instances are SXM; SkyPilot has no name for the PCIe card alone
    "h100-nvl": "H100-NVL",
    "h200": "H200",
    "b200": "B200",
    "rtx-4090": "RTX4090",
    "rtx-a6000": "RTXA6000",
    "mi300x": "MI300X",
}
RAY_NAME = {
    "t4": "T4",
    "l4": "L4",
    "a10g": "A10G",
    "l40s": "L40S",
    "a100-40gb": "A100",  # Ray's detection names every A100 "A100"; the memory is the plan's to check
    "a100-80gb": "A100",
    "h100-sxm": "H100",
    "h100-pcie": "H100",
    "h100-nvl": "H100",
    "h200": "H200",
    "b200": "B200",
    "mi250x": "AMD-Instinct-MI250X-MI250",
}


def dump_yaml(docs: list[dict]) -> str:
    """YAML as people write it: a multi-line string (a script) as a literal block, keys in their order."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # the same dict twice is written twice, not as &id001
            return True

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=120)


def engine_name(table: dict[str, str], job_gpu: str, gpu_name: str, engine: str, hint: str) -> str:
    name = table.get(job_gpu)
    if name is None:
        raise GpuwiseError(f"gpuwise cannot name {gpu_name} in {engine}'s terms: {hint}")
    return name
