"""`gpuwise launch`: the plan's layout, the four engines' artifacts as each engine's own tools read them, the
refusals, and real jobs on a local Ray cluster (Slurm's: test_launch_slurm.py).

SkyPilot and kubernetes-validate live in a venv of their own (SkyPilot pins click and uvicorn), made once by
tests/engines/engines_venv.sh; the tests read the artifacts with those tools, as a user's cluster would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuwise.cli import main
from gpuwise.cli.launch import plan_command as plan_job
from gpuwise.errors import GpuwiseError
from gpuwise.launch.engines import K8S_PRODUCT, RAY_NAME, SKY_NAME, Options
from gpuwise.launch.registry import engines

ROOT = Path(__file__).resolve().parents[1]
ENGINES_VENV = ROOT / ".venv-engines"
K8S_VERSION = "1.37"  # the newest schema kubernetes-validate ships offline
# SkyPilot's canonical accelerator names (its catalog's accelerators.csv, v8). Task.from_yaml keeps any name
# as written (FOO:1 loads), and the catalog is fetched online, so the names are checked against this list.
SKY_CANONICAL = {"H100", "H200", "A100", "A100-80GB", "L4", "L40S", "A10G", "A10", "T4", "V100", "B200", "MI300X",
                 "RTX4090", "RTXA6000", "H100-NVL", "H100-SXM", "H200-SXM", "A100-80GB-SXM"}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from train_data import interactions_csv

    return interactions_csv(tmp_path_factory.mktemp("data") / "interactions.csv")


def train(data: Path, *extra: str) -> list[str]:
    return ["train", "recommender", "--data", str(data), "--model", "mf", "--batch-size", "16", "--max-steps", "20",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def engines_venv() -> Path:
    """SkyPilot and kubernetes-validate, in their own venv (about 2 minutes the first time)."""
    done = subprocess.run(["bash", str(ROOT / "tests/engines/engines_venv.sh"), str(ENGINES_VENV)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return ENGINES_VENV / "bin" / "python"


# --- the plan -----------------------------------------------------------------------------------------------


def test_the_layout_and_figures_come_from_the_plan(catalog, data, tmp_path):
    job = plan_job(train(data), catalog, gpu="h100-sxm", gpus=16, run_dir=str(tmp_path / "run"))
    c = job.choice
    assert (c.gpus, c.nodes, c.per_node) == (16, 2, 8)  # an H100 server holds 8 (catalog max_per_node)
    assert job.steps == 20 and job.global_batch == 16 and job.strategy == "ddp"
    assert c.fits and 2**30 < c.memory_bytes < c.capacity_bytes  # the traced step, plus 1 GiB of CUDA context
    assert c.wall_s == pytest.approx(20 * c.step_s)
    # the GPUs are billed for start-up, loading, evaluation and the checkpoint too, not the training alone
    assert c.billed_s == pytest.approx(c.wall_s + 900) and c.gpu_hours == pytest.approx(c.billed_s / 3600 * 16)
    cheapest = min(p.usd_per_gpu_hour for p in catalog.prices("h100-sxm"))
    assert c.price is not None and c.price["usd_per_gpu_hour"] == cheapest
    assert c.usd == pytest.approx(c.gpu_hours * cheapest)
    assert job.time_limit_s >= 1.5 * c.wall_s + 900 and job.time_limit_s % 60 == 0
    assert job.train_command() == [*train(data), "--devices", "8", "--num-nodes", "2", "--accelerator", "cuda",
                                   "--strategy", "ddp", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    script = job.node_script("python", "$RANK", "head", "id")
    assert (f"--nnodes=2 --nproc-per-node=8 --node-rank=$RANK --rdzv-backend=c10d --rdzv-endpoint=head:{job.rdzv_port}"
            in script) and 29500 <= job.rdzv_port < 30500  # fmt: skip
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=240" in script  # time to write the checkpoint after TERM
    assert f"set -- train --resume {tmp_path / 'run'}" in script  # a requeued job continues its run


def test_without_gpu_the_cheapest_whole_job_is_chosen_and_the_next_ones_are_fallbacks(catalog, data):
    job = plan_job(train(data), catalog)
    options = [job.choice, *job.alternatives]
    assert len(options) == 3 and all(o.fits and o.usd is not None for o in options)
    assert [o.usd for o in options] == sorted(o.usd for o in options)  # type: ignore[type-var]
    priced = [a for a in catalog.accelerators.values() if a.kind == "gpu" and catalog.prices(a.slug)]
    for acc in priced:  # none of the others is cheaper for the whole job
        other = plan_job(train(data), catalog, gpu=acc.slug).choice
        assert other.usd is None or other.usd >= job.choice.usd * (1 - 1e-9)


def test_the_planned_memory_is_what_a_run_measures(catalog, data, tmp_path, capsys):
    """The launch plans as `gpuwise train` does before its first step; on CPU processes (no CUDA context to
    add) it is held to what a run then measures, to 10 % (tests/test_plan_vs_actual.py's tolerance)."""
    argv = train(data, "--precision", "32-true")
    job = plan_job(argv, catalog, gpu="cpu", run_dir=str(tmp_path / "planned"))
    assert main([*argv, "--accelerator", "cpu", "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["actual"]["peak_bytes"]
    assert job.choice.memory_bytes == pytest.approx(measured, rel=0.10)


# --- refusals: one line, nothing written, nothing submitted ----------------------------------------------------


def one_line(capsys, argv: list[str], expect: str, where: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpuwise: error: ") and expect in err[-1], err
    assert not [p for p in where.iterdir() if p.name.startswith("gpuwise-")], "an artifact was written"


def test_refusals_are_one_line_before_anything_is_written(capsys, data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = tmp_path / "small.csv"
    t4 = (ROOT / "src/gpuwise/hardware/data/accelerators.csv").read_text().splitlines()
    small.write_text(t4[0] + "\n" + next(r for r in t4 if r.startswith("t4,")).replace("t4,NVIDIA T4", "tiny,Tiny", 1)
                     .replace(",16,320,", ",0.5,320,", 1) + "\n")  # fmt: skip
    cases = [
        (["slurm", "--gpu", "tiny", "--catalog", str(small)], "the plan does not fit Tiny"),
        (["slurm", "--gpu", "h100-sxm", "--gpus", "16", "--nodes", "1"], "its servers hold at most 8"),
        (["slurm", "--gpu", "h100-sxm", "--gpus", "9", "--nodes", "2"], "do not split evenly over 2 nodes"),
        (["ray", "--gpu", "rtx-3090"], "cannot name NVIDIA RTX 3090 in Ray's terms"),
        (["k8s", "--gpu", "mi300x"], "cannot name AMD MI300X in Kubernetes's terms"),
        (["skypilot", "--gpu", "tpu-v5p"], "is a tpu"),
        (["skypilot", "--gpu", "h100-sxm", "--max-cost", "0"], "over --max-cost $0.00"),
        (["skypilot", "--gpu", "mi300x", "--max-cost", "5"], "no cloud price is known for AMD MI300X"),
        (["skypilot", "--gpu", "h100-sxm", "--managed"], "give --bucket NAME"),
        (["skypilot", "--gpu", "h100-sxm", "--gpus", "16"], "2 nodes need one run directory they all see"),
        (["slurm", "--run-dir", "my runs/x"], "Slurm's --output cannot hold a space"),
        (["slurm", "--gpu", "h100-sxm", "--gpus", "3"], "global batch 16 must be divisible by the 3 processes"),
    ]
    for flags, expect in cases:
        one_line(capsys, ["launch", *flags, "--", *train(data)], expect, tmp_path)
    for job, expect in [
        ([], "give the job after --"),
        (train(data, "--devices", "2"), "train --devices is set by the launch: use --gpus and --nodes"),
        (train(data, "--resume", "x"), "train --resume is set by the launch"),
        (train(data, "--max-stepz", "3"), "the train command: No such option: --max-stepz"),
        (["train", "no-such-workload"], "no-such-workload"),
    ]:
        one_line(capsys, ["launch", "slurm", "--", *job], expect, tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no engine client on it
    for engine, client in (("slurm", "sbatch"), ("skypilot", "sky"), ("k8s", "kubectl")):
        one_line(capsys, ["launch", engine, "--gpu", "h100-sxm", "--submit", "--", *train(data)],
                 f"needs {engine}'s client `{client}` (not on PATH)", tmp_path)  # fmt: skip


def test_an_engine_without_a_cluster_is_one_line(capsys, data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    port = free_port()  # nothing listens there
    one_line(capsys, ["launch", "ray", "--gpu", "cpu", "--gpus", "2", "--submit", "--address",
                      f"http://127.0.0.1:{port}", "--", *train(data)], "no Ray cluster answers", tmp_path)  # fmt: skip


def test_a_ray_cluster_that_asks_for_a_token_is_one_line_that_says_how(capsys, data, tmp_path, monkeypatch):
    """A dashboard with Ray's token authentication on answers 401 (its own words) to a client without the token."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuses(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b"Unauthorized: Missing authentication token"
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        one_line(capsys, ["launch", "ray", "--gpu", "cpu", "--gpus", "2", "--submit", "--address",
                          f"http://127.0.0.1:{server.server_port}", "--", *train(data)],
                 "Missing authentication token (its token authentication: set RAY_AUTH_MODE=token",
                 tmp_path)  # fmt: skip
    finally:
        server.shutdown()


# --- the artifacts, read by each engine's own tools --------------------------------------------------------------


def test_every_name_gpuwise_gives_an_accelerator_is_the_engines_own(catalog):
    from ray.util import accelerators

    ray_names = {v for k, v in vars(accelerators.accelerators).items() if k.isupper() and isinstance(v, str)}
    assert set(RAY_NAME.values()) <= ray_names
    assert set(SKY_NAME.values()) <= SKY_CANONICAL
    assert all(slug in catalog.accelerators for table in (RAY_NAME, SKY_NAME, K8S_PRODUCT) for slug in table)


def artifact(engine: str, job, opts: Options, where: Path) -> Path:
    chosen = engines()[engine]
    chosen.check(job, opts)
    path = where / (job.name + chosen.suffix)
    path.write_text(chosen.render(job, opts))
    return path


@pytest.mark.parametrize("gpus, gpu", [(16, "h100-sxm"), (2, "cpu"), (1, "l4")])
def test_kubernetes_manifests_validate_offline(catalog, data, tmp_path, engines_venv, gpus, gpu):
    job = plan_job(train(data), catalog, gpu=gpu, gpus=gpus, run_dir=str(tmp_path / "run"))
    path = artifact("k8s", job, Options(image="registry.example/gpuwise:1"), tmp_path)
    check = ("import sys, yaml, kubernetes_validate as k\n"
             "for d in yaml.safe_load_all(open(sys.argv[1])):\n"
             f"    k.validate(d, '{K8S_VERSION}', strict=True)\n")  # fmt: skip
    done = subprocess.run([str(engines_venv), "-c", check, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    pvc, service, k8s_job = yaml.safe_load_all(path.read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and service["spec"]["clusterIP"] == "None"
    spec = k8s_job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == job.choice.nodes
    assert spec["activeDeadlineSeconds"] == job.time_limit_s
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    limits = pod["containers"][0]["resources"]["limits"]
    if gpu == "cpu":
        assert "nvidia.com/gpu" not in limits and "nodeSelector" not in pod
    else:
        assert limits["nvidia.com/gpu"] == job.choice.per_node
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": K8S_PRODUCT[gpu]}
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    # The validator has no enums and lets an unknown field through only without strict: it does catch one.
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("completionMode: Indexed", "completionMode: Indexed\n  parallelizm: 2"))
    assert subprocess.run([str(engines_venv), "-c", check, str(bad)], capture_output=True).returncode != 0


@pytest.mark.parametrize("managed", [False, True])
def test_skypilot_loads_the_task_and_its_resources_match_the_plan(catalog, data, tmp_path, engines_venv, managed):
    sky = engines()["skypilot"].names
    job = plan_job(train(data), catalog, gpus=16, run_dir=str(tmp_path / "run"), nameable=sky)  # the best, 2 x 8
    opts = Options(managed=managed, spot=managed, bucket="team-runs")
    path = artifact("skypilot", job, opts, tmp_path)
    done = subprocess.run([str(engines_venv), str(ROOT / "tests/engines/check_sky.py"), str(path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    task = json.loads(done.stdout)
    assert task["num_nodes"] == 2 and task["resources_kind"] == "ordered"
    wanted = [{SKY_NAME[c.gpu]: 8} for c in (job.choice, *job.alternatives)]
    wanted = [w for i, w in enumerate(wanted) if w not in wanted[:i]]
    assert [r["accelerators"] for r in task["resources"]] == wanted  # tried in gpuwise's order: cheapest job first
    for r in task["resources"]:
        assert r["use_spot"] is managed
        if managed:
            assert r["job_recovery"]["strategy"] == "FAILOVER"
        else:
            assert r["autostop"]["idle_minutes"] == 10
    assert task["storage_mounts"]["/gpuwise-runs"]["name"] == "team-runs"
    assert task["storage_mounts"]["/gpuwise-runs"]["mode"] == "MOUNT_CACHED"
    for var in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE", "SKYPILOT_NUM_NODES"):
        assert f"${var}" in task["run"]
    assert "set -- train --resume /gpuwise-runs/run" in task["run"]  # a recovered job continues its run
    assert "pip install" in task["setup"]
    # The local data file travels with the task: SkyPilot copies it to the nodes, where the command reads it.
    copied = {there: here for there, here in task["file_mounts"].items()}
    assert list(copied.values()) == [str(data)]
    assert f"--data {next(iter(copied))}" in task["run"]


@pytest.mark.parametrize("engine", ["k8s", "skypilot"])
def test_the_teams_record_reaches_the_job_by_the_engines_secret_never_its_artifact(engine, data, tmp_path, capsys,
                                                                                  monkeypatch):  # fmt: skip
    """Issue #52: with GPUWISE_DB a server, the job's nodes get its address from a Kubernetes Secret (made from a
    file: kubectl renders it, apply stores it) or SkyPilot's --secret (its value from sky's environment). Stand-in
    clients log what they are handed: the URL is in no argument and no artifact."""
    url = "postgresql://team:s3cret-pw@db.internal:5432/gpuwise"
    monkeypatch.setenv("GPUWISE_DB", url)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    client = bin_dir / ("kubectl" if engine == "k8s" else "sky")
    # logs its arguments, the URL it got from its environment, and (kubectl) the file --from-file names
    client.write_text(f"""#!/bin/sh
echo "$* | env=${{GPUWISE_DB:-}}" >> {bin_dir}/calls
for a in "$@"; do case "$a" in --from-file=url=*) cat "${{a#--from-file=url=}}" > {bin_dir}/secret-file;
  stat -c %a "${{a#--from-file=url=}}" > {bin_dir}/secret-mode;; esac; done
""")
    client.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpuwise.runs.db.try_record", lambda *a, **k: 1)  # the record itself is not this test's
    extra = ["--image", "registry/gpuwise:1"] if engine == "k8s" else []
    assert main(["launch", engine, "--gpu", "l4", "--submit", *extra, "--json", "--", *train(data)]) == 0, (
        capsys.readouterr().err)  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    artifact_text = Path(out["artifact"]).read_text()
    assert "s3cret" not in artifact_text and "db.internal" not in artifact_text
    calls = (bin_dir / "calls").read_text().splitlines()
    assert all("s3cret" not in line.split(" | ")[0] for line in calls), calls  # never an argument
    if engine == "k8s":
        assert "create secret generic gpuwise-record --from-file=url=" in calls[0] and "--dry-run=client" in calls[0]
        assert (bin_dir / "secret-file").read_text() == url and (bin_dir / "secret-mode").read_text().strip() == "600"
        assert calls[1].startswith("apply -f - ") and calls[2].startswith(f"apply -f {out['artifact']}")
        k8s_job = list(yaml.safe_load_all(artifact_text))[-1]
        env = k8s_job["spec"]["template"]["spec"]["containers"][0]["env"]
        assert env == [{"name": "GPUWISE_DB", "valueFrom": {"secretKeyRef": {"name": "gpuwise-record", "key": "url",
                                                                             "optional": True}}}]  # fmt: skip
    else:
        assert "--secret GPUWISE_DB" in calls[0] and calls[0].endswith(f"env={url}")
        assert yaml.safe_load(artifact_text.split("\n", 2)[2])["secrets"] == {"GPUWISE_DB": None}


def test_the_slurm_script_runs_one_torchrun_per_node_and_requeues_on_the_signal(catalog, data, tmp_path):
    job = plan_job(train(data), catalog, gpu="h100-sxm", gpus=16, run_dir=str(tmp_path / "run"))
    text = artifact("slurm", job, Options(partition="gpu", account="ml", qos="high", gres_type="h100"), tmp_path)
    script = text.read_text()
    from gpuwise.launch.slurm import SIGNAL_AHEAD_S

    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=h100:8", "--cpus-per-task=64", "--requeue",
                 f"--signal=B:USR1@{SIGNAL_AHEAD_S}", "--partition=gpu", "--account=ml", "--qos=high"):  # fmt: skip
        assert f"#SBATCH {line}\n" in script
    from gpuwise.launch.slurm import hms

    assert f"#SBATCH --time={hms(job.time_limit_s)}\n" in script
    assert "srun --kill-on-bad-exit=1" in script and "--nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node=8" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "--node-rank" not in script  # srun runs no shell: c10d numbers the nodes
    assert subprocess.run(["bash", "-n", str(text)]).returncode == 0


# --- a real Ray cluster -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head --num-cpus 2`: a real local cluster, with the Jobs API on its dashboard."""
    ray = Path(sys.executable).with_name("ray")
    dashboard, gcs = free_port(), free_port()
    # Token auth off, said outright: a ~/.ray/auth_token left by any local ray.init() turns it on otherwise.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    # Started as a cluster started in the background is (`nohup ray start`, `ray start ... &` in a script): with
    # SIGINT ignored, which its workers inherit. A Ray task's cancel never reaches such a worker; the endpoint's
    # stop must not need it.
    started = subprocess.run([str(ray), "start", "--head", "--num-cpus", "2", "--port", str(gcs), "--dashboard-port",
                              str(dashboard), "--include-dashboard", "true", "--disable-usage-stats"],
                             capture_output=True, text=True, env=env, timeout=180,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120)


def wait_for(record_id: int, states: set[str], timeout: float = 300) -> dict:
    from gpuwise.launch.status import status
    from gpuwise.results import LaunchRecord
    from gpuwise.runs import db

    deadline = time.monotonic() + timeout
    while True:
        now = status(db.load_data(db.get(record_id), LaunchRecord))
        if now["state"] in states and ("summary" in now or now["state"] not in ("SUCCEEDED", "COMPLETED")):
            return now
        assert time.monotonic() < deadline, f"the job is still {now['state']} after {timeout} s"
        time.sleep(2)


@pytest.mark.slow
def test_a_ray_job_trains_two_workers_and_matches_a_local_two_process_run(ray_cluster, data, tmp_path, capsys,
                                                                        monkeypatch, postgres):  # fmt: skip
    """... and writes its run into the team's PostgreSQL (issue #52), the address given in the job's runtime_env
    at submit time, not in the artifact."""
    from test_train_loop import assert_same_training, torchrun

    from gpuwise.runs import db

    monkeypatch.setenv("GPUWISE_DB", postgres.database())
    monkeypatch.chdir(tmp_path)
    exact = ["--precision", "32-true", "--batch-size", "8", "--max-steps", "4"]
    job = ["train", "recommender", "--data", str(data), "--model", "mf", *exact]
    ray = ["--address", ray_cluster, "--python", sys.executable]  # the cluster runs this venv's Python
    assert main(["launch", "ray", "--gpu", "cpu", "--gpus", "2", "--submit", *ray,
                 "--run-dir", str(tmp_path / "ray-run"), "--json", "--", *job]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["job_id"] and out["record_id"] and Path(out["artifact"]).is_file()
    assert "postgresql" not in Path(out["artifact"]).read_text()
    now = wait_for(out["record_id"], {"SUCCEEDED", "FAILED", "STOPPED"})
    assert now["state"] == "SUCCEEDED", now
    [trained] = db.rows("train")  # written by the job's rank 0, on its node, into the same PostgreSQL
    assert trained["run_dir"] == str(tmp_path / "ray-run") and trained["data"]["steps"] == 4
    summary = now["summary"]
    assert summary["device"] == "cpu x 2" and summary["strategy"] == "ddp" and summary["steps"] == 4
    planned, actual = now["planned_vs_actual"]["wall_s"]
    assert planned > 0 and actual > 0
    torchrun([*job, "--run-dir", str(tmp_path / "local"), "--devices", "2", "--accelerator", "cpu"], free_port())
    assert_same_training(tmp_path / "local", tmp_path / "ray-run")
    assert main(["runs", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["kind"] for r in rows].count("launch") == 1
    assert main(["runs"]) == 0
    listed = capsys.readouterr().out
    assert "launch" in listed and "SUCCEEDED;" in listed and "(planned" in listed  # the state, planned beside actual
    # A cluster without the node shape the job needs is refused before submitting (it would pend for ever).
    monkeypatch.chdir(tmp_path / "local")
    one_line(capsys, ["launch", "ray", "--gpu", "cpu", "--gpus", "4", "--submit", "--address", ray_cluster, "--",
                      *job], "has 0 of the 1 nodes the job needs", tmp_path / "local")  # fmt: skip


# --- one planner: the job launch writes is planned as train plans the run ------------------------------------


def torchrun(args: list[str]) -> dict:
    """`gpuwise train` under torchrun with 2 CPU processes (gloo), as the job's nodes run it: its summary."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    done = subprocess.run([*launcher, "-m", "gpuwise", *args, "--devices", "2", "--json"], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "strategy"), [("defects", "ddp"), ("defects", "fsdp"), ("product-lm", "ddp")])
def test_launch_plans_the_job_as_train_plans_the_run(catalog, tmp_path, workload, strategy):
    """The same job planned by `gpuwise launch --gpu cpu --gpus 2` and by the `gpuwise train` of 2 processes that
    runs it: the same peak memory a process and FLOPs a step (defects: traced on fake tensors, or, sharded by
    FSDP, its saved activations with the states sharded; product-lm: the analytic formulas, launch's model on
    fake tensors with no weights), and the same step time but for the batch preparation each times itself."""
    from train_data import image_folder, reviews_jsonl

    given = {
        "defects": ["defects", "--data", str(image_folder(tmp_path / "cells")), "--image-size", "32",
                    "--batch-size", "8"],
        "product-lm": ["product-lm", "--base", "scratch", "--data", str(reviews_jsonl(tmp_path / "r.jsonl")),
                       "--block-size", "32", "--batch-size", "4"],
    }[workload]  # fmt: skip
    args = ["train", *given, "--max-steps", "2", "--strategy", strategy]
    job = plan_job(args, catalog, gpu="cpu", gpus=2, run_dir=str(tmp_path / "planned"))
    ran = torchrun([*args, "--run-dir", str(tmp_path / "run")])
    assert job.strategy == ran["strategy"] == strategy and job.plan["peak_bytes"] > 0
    assert job.plan["peak_bytes"] == ran["plan"]["peak_bytes"], (job.method, ran["plan"]["method"])
    assert job.plan["flops_per_step"] == ran["flops_per_step"]
    compute = job.plan["step_time_s"] - job.plan["data_s"]
    assert compute == pytest.approx(ran["plan"]["step_time_s"] - ran["plan"]["data_s"], rel=1e-9)
    assert job.plan["efficiency_origin"] == ran["plan"]["efficiency_origin"]


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_launch_plans_a_base_from_its_config_without_its_weights(catalog, tmp_path, method):
    """A base is planned from its config on fake tensors: a model directory whose weights are missing plans as
    one whose weights are there (a hub id's would never be downloaded), and QLoRA's frozen linear layers count
    as NF4, half a byte a weight."""
    from serving import tiny_chat_model

    from train_data import reviews_jsonl

    base = tiny_chat_model(tmp_path / "base")
    (base / "model.safetensors").unlink()  # `gpuwise train` could not load it; `gpuwise launch` needs no weights
    data = str(reviews_jsonl(tmp_path / "r.jsonl"))
    args = ["train", "product-lm", "--base", str(base), "--method", method, "--data", data, "--block-size", "32",
            "--batch-size", "8", "--max-steps", "2"]  # fmt: skip
    job = plan_job(args, catalog, gpu="h100-sxm", gpus=2, run_dir=str(tmp_path / "run"))
    assert "analytic" in job.method and job.plan["peak_bytes"] > 0 and job.plan["flops_per_step"] > 0
    if method == "qlora":
        lora = plan_job([*args[:5], "lora", *args[6:]], catalog, gpu="h100-sxm", gpus=2, run_dir=str(tmp_path / "l"))
        assert job.plan["peak_bytes"] < lora.plan["peak_bytes"]


def test_what_needs_no_model_is_checked_before_the_model_is_built(catalog, tmp_path, capsys):
    """An odd batch over 2 processes is one line at once: no data read, no base resolved (this one does not
    exist, and would be the error were it looked at first)."""
    args = ["train", "product-lm", "--base", "someone/no-such-model", "--batch-size", "7"]
    with pytest.raises(GpuwiseError, match="global batch 7 must be divisible by the 2 processes"):
        plan_job(args, catalog, gpu="h100-sxm", gpus=2, run_dir=str(tmp_path / "run"))
    assert "planning product-lm" not in capsys.readouterr().err  # the workload was never built


@pytest.mark.slow
def test_a_ray_endpoint_serves_the_openai_client_and_stops_draining(ray_cluster, tmp_path, capsys, monkeypatch):
    from test_launch_endpoint import SMOL, answers_and_drains

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPUWISE_API_KEY", raising=False)
    assert main(["launch", "ray", "--gpu", "cpu", "--submit", "--address", ray_cluster, "--python", sys.executable,
                 "--run-dir", str(tmp_path / "endpoint"), "--json", "--", "serve", SMOL, "--max-seqs", "4",
                 "--no-record"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    answers_and_drains(out["record_id"], Path(out["artifact"]), capsys, monkeypatch)
    wait_for(out["record_id"], {"STOPPED"}, timeout=120)
