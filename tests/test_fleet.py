"""Issue #53: `gpuwise fleet` over a small real fleet. A one-node Slurm cluster with its accounting (slurmdbd on
MariaDB, tests/engines/slurm_accounting.sh; 4 stand-in GPUs as Slurm generic resources on this CPU machine), a
local Ray cluster, gpuwise's record on a real PostgreSQL: jobs of two accounts, one of them a gpuwise training
run measured inside its Slurm job, a plain Ray job, a local run of a third team, and an endpoint left idle.

On this machine the "GPUs" are Slurm's gres stand-ins and a run measures its CPU: the figures' plumbing is what
is checked (allocation to the second, the join of measured use to jobs, the idle alarm, own or rent from the
measured share), not GPU utilization itself, which benchmarks/gpu_truth.sh checks where a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwise.cli import main

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
GPUWISE = Path(sys.executable).parent / "gpuwise"

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="Slurm's daemons run as root here (SlurmUser=root)")
pytestmark = [pytest.mark.slow, ROOT_ONLY]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Accounting first (a slurmctld with a database and no state dies without it), then the cluster on it."""
    acct, where = tmp_path_factory.mktemp("acct"), tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(ROOT / "tests/engines/slurm_accounting.sh"), "up", str(acct)],
                        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert up.returncode == 0, up.stderr[-2000:]
    env = dict(os.environ, SLURM_LOCAL_ACCT_DIR=str(acct))
    up = subprocess.run(["bash", str(ROOT / "tests/engines/slurm_local.sh"), "up", str(where)], capture_output=True,
                        text=True, timeout=600, env=env)  # fmt: skip
    assert up.returncode == 0, up.stderr[-2000:]
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(where / "slurm.conf")
    try:
        for argv in (["add", "account", "team-a", "team-b"], ["add", "user", "root", "account=team-a,team-b"]):
            done = subprocess.run(["sacctmgr", "-i", *argv], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        yield where
    finally:
        subprocess.run(["bash", str(ROOT / "tests/engines/slurm_local.sh"), "down", str(where)], capture_output=True)
        subprocess.run(["bash", str(ROOT / "tests/engines/slurm_accounting.sh"), "down", str(acct)],
                       capture_output=True)  # fmt: skip
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture(scope="module")
def ray_cluster():
    """`ray start --head`: a real local cluster, its Jobs API on the dashboard."""
    from record_servers import free_port

    ray = Path(sys.executable).with_name("ray")
    dashboard, gcs = free_port(), free_port()
    # token auth off, said outright: a ~/.ray/auth_token left by any local ray.init() turns it on otherwise
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    started = subprocess.run([str(ray), "start", "--head", "--num-cpus", "2", "--port", str(gcs), "--dashboard-port",
                              str(dashboard), "--include-dashboard", "true", "--disable-usage-stats"],
                             capture_output=True, text=True, env=env, timeout=180)  # fmt: skip
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(ray), "stop", "--force"], capture_output=True, timeout=120)


def sbatch(*argv: str) -> str:
    done = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def sacct() -> dict[str, dict]:
    fields = ("JobID", "Account", "State", "ElapsedRaw", "AllocTRES")
    done = subprocess.run(["sacct", "-a", "-X", "-P", "-n", "-S", "now-2hours", f"--format={','.join(fields)}"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in done.stdout.splitlines()]
    return {r["JobID"]: r for r in rows}


def finished(*jobs: str, timeout: float = 300) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = sacct()
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # "CANCELLED by 0": its first word
        if all(rows.get(j, {}).get("State", "").split(" ")[0] in ended for j in jobs):
            return rows
        assert time.monotonic() < deadline, rows
        time.sleep(1)


def fleet(*argv: str) -> tuple[int, dict]:
    done = subprocess.run([str(GPUWISE), "fleet", "--since", "2h", "--json", *argv], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode in (0, 1) and done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def test_a_small_fleet_is_counted_to_the_second_its_idle_endpoint_named_and_owning_priced_at_measured_use(
    cluster, ray_cluster, postgres, tmp_path, monkeypatch
):
    monkeypatch.setenv("GPUWISE_DB", postgres.database())
    monkeypatch.setenv("GPUWISE_USAGE_INTERVAL_S", "0.2")  # sampled often and kept every second: a test's runs are
    monkeypatch.setenv("GPUWISE_USAGE_FLUSH_S", "1")  # short (sbatch passes both on to the jobs)
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.chdir(tmp_path)

    # team-a: a gpuwise training run inside a Slurm job holding 1 GPU; team-b: 2 GPUs held by a job gpuwise never saw
    trained = sbatch("--account=team-a", "--gpus=1", "--mem=2G", "--job-name=tiny", "--wrap",
                     f"{GPUWISE} train tiny_workload:Tiny --max-steps 60 --accelerator cpu --run-dir {tmp_path / 'a'}")
    unseen = sbatch("--account=team-b", "--gpus=2", "--mem=100M", "--job-name=held", "--wrap", "sleep 2")
    # a Ray job, and a local run of a third team
    from ray.job_submission import JobSubmissionClient

    ray = JobSubmissionClient(ray_cluster)
    ray_id = ray.submit_job(entrypoint="sleep 1", entrypoint_num_cpus=1)
    local = subprocess.run([str(GPUWISE), "train", "tiny_workload:Tiny", "--max-steps", "3", "--accelerator", "cpu",
                            "--run-dir", str(tmp_path / "local")], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, GPUWISE_TEAM="team-c"))  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    rows = finished(trained, unseen)
    assert rows[trained]["State"] == "COMPLETED", (tmp_path / f"slurm-{trained}.out").read_text()[-2000:]
    deadline = time.monotonic() + 120
    while str(ray.get_job_status(ray_id)) not in ("SUCCEEDED", "JobStatus.SUCCEEDED"):
        assert time.monotonic() < deadline
        time.sleep(0.5)

    # an endpoint no one calls: held, idle
    assert main(["launch", "slurm", "--gpu", "cpu", "--account", "team-b", "--submit", "--run-dir",
                 str(tmp_path / "endpoint"), "--json", "--", "serve", "smollm2-135m-instruct", "--max-seqs", "2",
                 "--no-record"]) == 0  # fmt: skip
    deadline = time.monotonic() + 300
    while True:  # until it has served nothing for 3 s
        usage = list((tmp_path / "endpoint").glob("*.usage.json"))
        tail = json.loads(usage[0].read_text()).get("idle_tail_s") if usage else None
        if tail and tail > 3:
            break
        assert time.monotonic() < deadline, "the endpoint never came up"
        time.sleep(1)
    code, now = fleet("--idle", "2s", "--by", "team")
    assert code == 1 and [j["engine"] for j in now["idle"]] == ["endpoint"], now["idle"]
    [idle] = now["idle"]
    assert idle["team"] == "team-b" and idle["idle_for_s"] > 2 and idle["workload"] == "smollm2-135m-instruct"
    assert fleet("--idle", "1h")[0] == 0  # not idle that long
    endpoint_job = idle["job"]
    subprocess.run(["scancel", endpoint_job.split("_")[0]], check=True, timeout=60)
    finished(endpoint_job)

    code, report = fleet("--by", "team", "--gpu-type", "gpu=h100-sxm")
    assert code == 0 and report["sources"]["slurm"] == 3 and report["sources"]["ray"] >= 1, report["sources"]
    jobs = {(j["source"], j["job"]): j for j in report["jobs"]}
    for job_id, row in sacct().items():  # every job as Slurm's accounting has it, to the second
        mine = jobs[("slurm", job_id)]
        assert round(mine["hours"] * 3600) == int(row["ElapsedRaw"]) and mine["team"] == row["Account"], (mine, row)
    assert jobs[("slurm", unseen)]["devices"] == 2 and jobs[("slurm", unseen)]["utilization"] is None
    measured = jobs[("slurm", trained)]
    assert measured["gpu"] == "h100-sxm" and measured["devices"] == 1 and measured["workload"] == "tiny_workload:Tiny"
    assert 0 <= measured["utilization"] <= 1 and measured["utilization_source"].startswith("gpuwise")
    info = ray.get_job_info(ray_id)
    mine = jobs[("ray", ray_id)]
    assert mine["hours"] * 3600 == pytest.approx((info.end_time - info.start_time) / 1000, abs=1e-6)
    groups = {g["team"]: g for g in report["groups"]}
    assert {"team-a", "team-b", "team-c"} <= set(groups)
    assert groups["team-c"]["jobs"] == 1 and groups["team-c"]["utilization"] is not None
    assert groups["team-a"]["gpu_hours"] == pytest.approx(int(sacct()[trained]["ElapsedRaw"]) / 3600)
    [line] = [o for o in report["own_or_rent"] if o["gpu"] == "h100-sxm"]
    assert line["utilization_measured"] and line["busy_share_of_allocation"] == pytest.approx(measured["utilization"])
    assert line["allocated_gpu_hours"] == pytest.approx(
        sum(j["device_hours"] for j in report["jobs"] if j["gpu"] == "h100-sxm"))
    text = subprocess.run([str(GPUWISE), "fleet", "--since", "2h", "--gpu-type", "gpu=h100-sxm"], capture_output=True,
                          text=True, timeout=120).stdout  # fmt: skip
    said = " ".join(text.split())  # as a terminal of any width wraps it
    from gpuwise.cli.fleet import _h

    assert f"h100-sxm: {_h(line['allocated_gpu_hours'])} GPU-h allocated, busy" in said, said
    assert "(measured)" in said and f"{line['cheaper']} is cheaper" in said, said


@pytest.fixture(scope="module")
def prometheus_server(tmp_path_factory):
    """Debian's prometheus on loopback, scraping what the test names in targets.json every second."""
    import shutil

    from record_servers import free_port, wait_ready

    binary = shutil.which("prometheus")
    if binary is None:
        done = subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        binary = shutil.which("prometheus")
    where = tmp_path_factory.mktemp("prometheus")
    (where / "targets.json").write_text("[]")
    (where / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n  - job_name: gpuwise\n    file_sd_configs: [{files: ['" + str(where / "targets.json") +
        "'], refresh_interval: 1s}]\n"
    )  # fmt: skip
    port = free_port()
    log = open(where / "prometheus.log", "wb")  # noqa: SIM115 - held for the server's life
    proc = subprocess.Popen([str(binary), f"--config.file={where / 'prometheus.yml'}",
                             f"--storage.tsdb.path={where / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/-/ready", proc, where / "prometheus.log")
        yield url, where / "targets.json"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_prometheus_gives_the_use_of_a_job_gpuwise_never_saw(cluster, prometheus_server, postgres, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """A Slurm job serving a model gpuwise never launched nor recorded: Prometheus scrapes its /metrics (the
    gauges labelled with its Slurm job id), and fleet --prometheus reads its use from there."""
    import urllib.parse
    import urllib.request

    from record_servers import free_port

    url, targets = prometheus_server
    monkeypatch.setenv("GPUWISE_DB", postgres.database())
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setenv("GPUWISE_USAGE_INTERVAL_S", "0.2")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    trained = subprocess.run([str(GPUWISE), "train", "tiny_workload:Tiny", "--max-steps", "2", "--accelerator", "cpu",
                              "--run-dir", str(run)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    port = free_port()
    serve = f"exec {GPUWISE} serve {run} --workload tiny_workload:Tiny --host 127.0.0.1 --port {port}"
    job = sbatch("--account=team-b", "--mem=1G", "--job-name=served", "--wrap", serve)
    targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"]}]))
    query = urllib.parse.urlencode({"query": f'gpuwise_device_utilization_ratio{{hpc_job="{job}"}}'})
    deadline, seen = time.monotonic() + 180, 0
    while seen < 5:  # five scrapes of the job's gauges
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as r:
            result = json.loads(r.read())["data"]["result"]
        seen += bool(result)
        queued = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, timeout=30).stdout
        assert queued.strip() and time.monotonic() < deadline, (tmp_path / f"slurm-{job}.out").read_text()[-2000:]
        time.sleep(1)
    try:
        code, report = fleet("--prometheus", url, "--idle", "1s")
        mine = next(j for j in report["jobs"] if j["source"] == "slurm" and j["job"] == job)
        assert mine["utilization_source"].startswith("prometheus (gpuwise's /metrics, by hpc_job"), mine
        assert 0 <= mine["utilization"] < 0.5 and mine["idle_share"] > 0.5  # a server no one calls
        assert code == 1 and job in [j["job"] for j in report["idle"]]
        down = fleet("--prometheus", "http://127.0.0.1:1")[1]
        assert any(n.startswith("Prometheus at http://127.0.0.1:1:") for n in down["notes"]), down["notes"]
        unmeasured = next(j for j in down["jobs"] if j["source"] == "slurm" and j["job"] == job)
        assert unmeasured["utilization"] is None  # nothing is made up when the source is down
    finally:
        subprocess.run(["scancel", job], timeout=60)
