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
from gpuwise.launch.endpoint import DRAIN_S, KEY_NAME, PORT, PROBE_PATHS, Endpoint
from gpuwise.launch.engines import (
    K8S_PRODUCT,
    RECORD_ENV_K8S,
    STATE_TIMEOUT_S,
    Engine,
    Options,
    dump_yaml,
    k8s_record_secret,
    run_client,
)
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
                        "env": RECORD_ENV_K8S,
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
        k8s_record_secret([kubectl, *ns])
        run_client([kubectl, *ns, "apply", "-f", str(artifact)], "kubectl apply")
        return job.name

    # --- an endpoint: a Deployment of its replicas, a Service in front, an HPA where it may grow -------------

    def secret_name(self, ep: Endpoint, opts: Options) -> str:
        return opts.key_secret or f"{ep.name}-key"

    def endpoint_manifests(self, ep: Endpoint, opts: Options) -> list[dict]:
        labels = {"app.kubernetes.io/name": "gpuwise", "gpuwise/endpoint": ep.name}
        meta = {"name": ep.name, "labels": labels} | ({"namespace": opts.namespace} if opts.namespace else {})
        port = opts.port or PORT
        limits: dict = {"cpu": str(ep.cpus), "memory": f"{ep.mem_gib}Gi"}
        selector: dict = {}
        if ep.accelerator == "cuda":
            limits["nvidia.com/gpu"] = ep.gpus
            selector["nvidia.com/gpu.product"] = K8S_PRODUCT[ep.gpu]
        probe = lambda path, period, failures: {  # noqa: E731
            "httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures}
        container = {
            "name": "serve",
            "image": opts.image or f"gpuwise:{__version__}",
            "command": [opts.python, "-m", "gpuwise", *ep.serve_command(host="0.0.0.0", port=port)],
            # The key from the Secret: never in this file, nor in the container's command line.
            "env": [{"name": "GPUWISE_API_KEY",
                     "valueFrom": {"secretKeyRef": {"name": self.secret_name(ep, opts), "key": KEY_NAME}}},
                    *RECORD_ENV_K8S],
            "ports": [{"containerPort": port, "name": "http"}],
            "resources": {"limits": limits, "requests": limits},
            # Loading a model takes minutes: the liveness probe waits for the startup probe, up to 30 min.
            "startupProbe": probe(PROBE_PATHS["live"], 10, 180),
            "livenessProbe": probe(PROBE_PATHS["live"], 10, 3),
            "readinessProbe": probe(PROBE_PATHS["ready"], 5, 2),
            # The Service stops sending new requests before TERM arrives: endpoints update within seconds.
            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        }
        pod = {
            "metadata": {"labels": labels},
            "spec": {
                # preStop's 5 s, then serve --grace to drain, then a margin before KILL
                "terminationGracePeriodSeconds": 5 + DRAIN_S + 10,
                **({"nodeSelector": selector} if selector else {}),
                "containers": [container],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{SHM_GIB}Gi"}}],
            },
        }
        docs = [
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": meta,
                "spec": {
                    "replicas": ep.replicas,
                    "selector": {"matchLabels": {"gpuwise/endpoint": ep.name}},
                    # one new replica before an old one goes: the endpoint keeps its capacity through a rollout
                    "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                    "template": pod,
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                "spec": {
                    "selector": {"gpuwise/endpoint": ep.name},
                    "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
                },
            },
        ]
        if ep.max_replicas > ep.replicas:
            # Running sequences per replica, from gpuwise's /metrics through a custom-metrics adapter
            # (prometheus-adapter; docs/launch.md): above the concurrency the serving plan expects a replica to
            # run at the traffic, another replica; without a plan, half of serve's --max-seqs.
            target = ep.figures.get("concurrency_per_replica") or max(1, int((ep.figures.get("max_seqs") or 32) // 2))
            docs.append(
                {
                    "apiVersion": "autoscaling/v2",
                    "kind": "HorizontalPodAutoscaler",
                    "metadata": meta,
                    "spec": {
                        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": ep.name},
                        "minReplicas": ep.replicas,
                        "maxReplicas": ep.max_replicas,
                        "metrics": [{"type": "Pods", "pods": {
                            "metric": {"name": "gpuwise_num_requests_running"},
                            "target": {"type": "AverageValue", "averageValue": str(target)}}}],
                    },
                }
            )  # fmt: skip
        return docs

    def render_endpoint(self, ep: Endpoint, opts: Options) -> str:
        secret = self.secret_name(ep, opts)
        made = "" if opts.key_secret else f" (--submit creates it from the key file; or kubectl create secret " \
            f"generic {secret} --from-file={KEY_NAME}=FILE)"
        return (f"# {ep.headline()}\n# kubectl apply -f this file; the key is the Secret {secret}, key {KEY_NAME}"
                f"{made}\n" + dump_yaml(self.endpoint_manifests(ep, opts)))  # fmt: skip

    def preflight_endpoint(self, ep: Endpoint, opts: Options) -> None:
        if not opts.image:
            raise GpuwiseError("--submit to Kubernetes needs --image: a container image with gpuwise installed")
        self.need_client()

    def submit_endpoint(self, artifact: Path, ep: Endpoint, opts: Options) -> str:
        kubectl = self.need_client()
        ns = ["-n", opts.namespace] if opts.namespace else []
        if not opts.key_secret:  # from the file: the key goes by its path, never on a command line
            run_client([kubectl, *ns, "create", "secret", "generic", self.secret_name(ep, opts),
                        f"--from-file={KEY_NAME}={ep.key_file}"], "kubectl create secret")  # fmt: skip
        k8s_record_secret([kubectl, *ns])
        run_client([kubectl, *ns, "apply", "-f", str(artifact)], "kubectl apply")
        return ep.name

    def stop(self, job_id: str, data: dict) -> str:
        kubectl = self.need_client()
        ns = ["-n", data["namespace"]] if data.get("namespace") else []
        if data.get("endpoint"):
            kinds = "deployment,service,hpa"
            run_client([kubectl, *ns, "delete", kinds, "-l", f"gpuwise/endpoint={job_id}"], "kubectl delete")
            if not data.get("key_secret"):
                run_client([kubectl, *ns, "delete", "secret", f"{job_id}-key", "--ignore-not-found"], "kubectl delete")
            return f"kubectl delete {kinds} of {job_id}: each pod leaves the Service, then drains on TERM"
        run_client([kubectl, *ns, "delete", "job", job_id], "kubectl delete job")
        return f"kubectl delete job {job_id}: each pod writes its checkpoint on TERM"

    def state(self, job_id: str, data: dict) -> str:
        kubectl = self.need_client()
        ns = ["-n", data["namespace"]] if data.get("namespace") else []
        if data.get("endpoint"):
            out = run_client([kubectl, *ns, "get", "deployment", job_id, "-o", "json"], "kubectl get deployment",
                             timeout=STATE_TIMEOUT_S)  # fmt: skip
            try:
                status = json.loads(out).get("status", {})
            except (ValueError, AttributeError):
                raise GpuwiseError(f"kubectl get deployment {job_id}: not the JSON of a Deployment") from None
            ready, want = status.get("readyReplicas", 0), status.get("replicas", 0)
            return f"{'READY' if want and ready == want else 'STARTING'} {ready}/{want}"
        out = run_client([kubectl, *ns, "get", "job", job_id, "-o", "json"], "kubectl get job", timeout=STATE_TIMEOUT_S)
        try:
            status = json.loads(out).get("status", {})
        except (ValueError, AttributeError):
            raise GpuwiseError(f"kubectl get job {job_id}: not the JSON of a Job") from None
        for cond in status.get("conditions", []):
            if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed", "Suspended"):
                return str(cond["type"]).upper()
        return "RUNNING" if status.get("active") else "PENDING"

