"""Kubernetes: an Indexed Job (one pod per node, each running torchrun), a headless Service that gives
pod 0 the DNS name the others rendezvous at, and a PersistentVolumeClaim for the run directory.

`nvidia.com/gpu` limits ask the device plugin for the node's GPUs; a node selector on the label NVIDIA's
GPU Feature Discovery sets (nvidia.com/gpu.product) asks for the planned model. activeDeadlineSeconds is
the plan's time limit. A pod that fails is replaced (backoffLimit), and resumes from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpuwise import __version__
from gpuwise.errors import GpuwiseError
from gpuwise.launch.engines import K8S_PRODUCT, STATE_TIMEOUT_S, Engine, Options, dump_yaml, run_client
from gpuwise.launch.job import SHUTDOWN_GRACE_S, Job

MOUNT = "/gpuwise-runs"
RETRIES = 3  # pods replaced after a failure (each resumes the run), then the Job fails
SHM_GIB = 16  # /dev/shm for NCCL and data-loader workers; a container's default is 64 MiB


def _labels(job: Job) -> dict:
    return {"app.kubernetes.io/name": "gpuwise", "gpuwise/job": job.name}


class Kubernetes(Engine):
    name, suffix, client = "k8s", ".k8s.yaml", "kubectl"
    install = "install kubectl (https://kubernetes.io/docs/tasks/tools/) with a kubeconfig for your cluster"
    names, title = K8S_PRODUCT, "Kubernetes"
    name_hint = "no nvidia.com/gpu.product label is known for it; pass another --gpu"

    def manifests(self, job: Job, opts: Options) -> list[dict]:
        c = job.choice
        run_dir = f"{MOUNT}/{Path(job.run_dir).name}"
        moved = job.moved(run_dir)
        head = f"{job.name}-0.{job.name}"  # pod 0's name under the headless Service (the Job's subdomain)
        script = moved.node_script(opts.python, "$JOB_COMPLETION_INDEX", head, job.name)
        limits: dict = {"cpu": str(job.cpus_per_node), "memory": f"{job.mem_per_node_gib}Gi"}
        selector: dict = {}
        if job.accelerator == "cuda":
            limits["nvidia.com/gpu"] = c.per_node
            selector["nvidia.com/gpu.product"] = K8S_PRODUCT[c.gpu]
        claim = opts.pvc or f"{job.name}-runs"
        meta = lambda name: {"name": name, "labels": _labels(job)} | (  # noqa: E731
            {"namespace": opts.namespace} if opts.namespace else {}
        )
        docs: list[dict] = []
        if not opts.pvc:
            size = {"storage": f"{opts.pvc_size_gib}Gi"}
            spec: dict = {"accessModes": ["ReadWriteMany"], "resources": {"requests": size}}
            if opts.storage_class:
                spec["storageClassName"] = opts.storage_class
            docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(claim), "spec": spec})
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta(job.name),
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,  # pod 0 must resolve before any pod is ready
                    "selector": {"gpuwise/job": job.name},
                    "ports": [{"name": "rendezvous", "port": job.rdzv_port}],
                },
            }
        )
        pod = {
            "metadata": {"labels": _labels(job)},
            "spec": {
                "subdomain": job.name,
                "restartPolicy": "Never",
                # TERM (a deleted or preempted pod): time to finish the step and write the checkpoint
                "terminationGracePeriodSeconds": SHUTDOWN_GRACE_S + 30,
                **({"nodeSelector": selector} if selector else {}),
                "containers": [
                    {
                        "name": "train",
                        "image": opts.image or f"gpuwise:{__version__}",
                        "command": ["bash", "-c", script],
                        "resources": {"limits": limits, "requests": limits},
                        "ports": [{"containerPort": job.rdzv_port, "name": "rendezvous"}],
                        "volumeMounts": [
                            {"name": "runs", "mountPath": MOUNT},
                            {"name": "shm", "mountPath": "/dev/shm"},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}},
                ],
            },
        }
        docs.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": meta(job.name),
                "spec": {
                    "completionMode": "Indexed",
                    "completions": c.nodes,
                    "parallelism": c.nodes,
                    "backoffLimit": RETRIES * c.nodes,
                    "activeDeadlineSeconds": job.time_limit_s,
                    "template": pod,
                },
            }
        )
        return docs

    def render(self, job: Job, opts: Options) -> str:
        return f"# {job.headline()}\n# kubectl apply -f this file\n" + dump_yaml(self.manifests(job, opts))

    def preflight(self, job: Job, opts: Options) -> None:
        if not opts.image:
            raise GpuwiseError("--submit to Kubernetes needs --image: a container image with gpuwise installed")
        self.need_client()

    def submit(self, artifact: Path, job: Job, opts: Options) -> str:
        kubectl = self.need_client()
        ns = ["-n", opts.namespace] if opts.namespace else []
        run_client([kubectl, *ns, "apply", "-f", str(artifact)], "kubectl apply")
        return job.name

    def state(self, job_id: str, data: dict) -> str:
        kubectl = self.need_client()
        ns = ["-n", data["namespace"]] if data.get("namespace") else []
        out = run_client([kubectl, *ns, "get", "job", job_id, "-o", "json"], "kubectl get job", timeout=STATE_TIMEOUT_S)
        try:
            status = json.loads(out).get("status", {})
        except (ValueError, AttributeError):
            raise GpuwiseError(f"kubectl get job {job_id}: not the JSON of a Job") from None
        for cond in status.get("conditions", []):
            if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed", "Suspended"):
                return str(cond["type"]).upper()
        return "RUNNING" if status.get("active") else "PENDING"

