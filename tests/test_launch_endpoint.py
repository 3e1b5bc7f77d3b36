"""`gpuwise launch ENGINE -- serve MODEL`: the endpoint's layout (the serving plan's, or the flags'), the
refusals, and each engine's artifact as its own tools read it (kubernetes-validate, SkyPilot's parser). Real
endpoints on Slurm and Ray: test_launch_slurm.py and test_launch.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuwise.cli import main
from gpuwise.launch.engines import K8S_PRODUCT, SKY_NAME

ROOT = Path(__file__).resolve().parents[1]
K8S_VERSION = "1.37"
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def engines_venv() -> Path:
    done = subprocess.run(["bash", str(ROOT / "tests/engines/engines_venv.sh"), str(ROOT / ".venv-engines")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return ROOT / ".venv-engines" / "bin" / "python"


@pytest.fixture
def key_file(tmp_path) -> tuple[Path, str]:
    key = "sk-endpoint-" + os.urandom(12).hex()
    path = tmp_path / "key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path, key


def launch(capsys, tmp_path, *argv: str) -> dict:
    args = list(argv)
    cut = args.index("--")
    code = main(["launch", *args[:cut], "--out", str(tmp_path / "artifact"), "--json", *args[cut:]])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def refused(capsys, argv: list[str], words: str, where: Path) -> None:
    before = set(where.iterdir()) | {where / "runs.sqlite"}  # the record, read by --stop
    assert main(["launch", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert set(where.iterdir()) <= before  # nothing written


def test_refusals_are_one_line_before_anything_is_written(capsys, tmp_path, monkeypatch, key_file):
    monkeypatch.chdir(tmp_path)
    open_key = tmp_path / "open-key"
    open_key.write_text("k\n")
    open_key.chmod(0o644)
    empty = tmp_path / "empty-key"
    empty.write_text("\n")
    empty.chmod(0o600)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no engine's client
    for argv, words in (
        (["k8s", "--gpu", "l4", "--", "serve", "llama-3.1-70b"], "does not fit 1 x NVIDIA L4"),
        (["slurm", "--gpu", "cpu", "--", "serve", SMOL, "--host", "0.0.0.0"], "serve --host is set by the launch"),
        (["slurm", "--gpu", "cpu", "--", "serve", SMOL, "--api-key", "k"], "serve --api-key is set by gpuwise launch"),
        (["slurm", "--gpu", "cpu", "--", "serve", SMOL, "--port=9000"], "serve --port is set by gpuwise launch --port"),
        (["slurm", "--gpu", "cpu", "--api-key-file", str(open_key), "--", "serve", SMOL], "others can read it"),
        (["slurm", "--gpu", "cpu", "--api-key-file", str(empty), "--", "serve", SMOL], "first line is empty"),
        (["slurm", "--gpu", "cpu", "--", "serve"], "name the model"),
        (["slurm", "--gpu", "cpu", "--", "serve", SMOL, "--max-seqs", "lots"], "the serve command:"),
        (["slurm", "--gpu", "cpu", "--", "serve", SMOL, "--model", "a=b"], "serves one model"),
        (["skypilot", "--gpu", "cpu", "--", "serve", SMOL], "SkyPilot rents GPU nodes"),
        (["ray", "--gpu", "rtx-3090", "--", "serve", SMOL], "cannot name NVIDIA RTX 3090 in Ray's terms"),
        (["slurm", "--gpu", "cpu", "--gpus", "2", "--", "serve", SMOL], "a CPU replica has none"),
        (["slurm", "--nodes", "2", "--", "serve", SMOL], "an endpoint's replica runs on one node"),
        (["slurm", "--key-secret", "s", "--", "serve", SMOL], "--key-secret names a Kubernetes Secret"),
        (["k8s", "--rps", "5", "--profile", "chat", "--gpus", "2", "--", "serve", "llama-3.1-8b"], "drop them"),
        (["k8s", "--rps", "5", "--profile", "chat", "--", "serve", "llama-3.1-8b", "--engine", "vllm"],
         "serve --engine is set by the serving plan"),  # fmt: skip
        (["k8s", "--rps", "5", "--", "serve", "llama-3.1-8b"], "needs the request lengths"),
        (["k8s", "--replicas", "2", "--", "train", "recommender"], "--replicas sizes an endpoint"),
        (["k8s", "--gpu", "l4", "--submit", "--image", "i", "--", "serve", SMOL], "needs k8s's client `kubectl`"),
        (["slurm", "--gpu", "cpu", "--submit", "--", "serve", SMOL], "needs slurm's client `sbatch`"),
        (["slurm", "--", "serve", SMOL, "--stop", "3"], "the serve command: No such option"),
        (["--stop", "7"], "#7"),
        (["slurm", "--stop", "7"], "give it alone"),
    ):
        refused(capsys, argv, words, tmp_path)


def test_without_traffic_the_layout_is_the_flags_and_the_cheapest_gpu_that_holds_the_model(capsys, tmp_path, catalog):
    from gpuwise.plan.capacity import gpu_replica
    from gpuwise.plan.model import resolve_model

    out = launch(capsys, tmp_path, "k8s", "--image", "i", "--", "serve", "llama-3.1-8b")
    f = out["plan"]
    spec = resolve_model("llama-3.1-8b")
    fits = [a for a in catalog.accelerators.values() if a.kind == "gpu" and a.slug in K8S_PRODUCT
            and gpu_replica(spec, a, "bf16", 1) is not None and catalog.prices(a.slug)]  # fmt: skip
    cheapest = min(fits, key=lambda a: min(p.usd_per_gpu_hour for p in catalog.prices(a.slug)))
    assert f["accelerator"] == cheapest.slug and f["gpus_per_replica"] == 1 and f["replicas"] == 1
    from gpuwise.plan.capacity import option_costs

    assert f["usd_per_month"] == option_costs(catalog, cheapest, 1, 24)[0]["usd_per_month"]  # the plan's own figure
    # given: the flags, as they are
    out = launch(capsys, tmp_path, "k8s", "--image", "i", "--gpu", "h100-sxm", "--gpus", "2", "--replicas", "3", "--",
                 "serve", "llama-3.1-8b")  # fmt: skip
    assert (out["plan"]["accelerator"], out["plan"]["gpus_per_replica"], out["plan"]["replicas"]) == ("h100-sxm", 2, 3)


def test_with_traffic_the_layout_is_the_serving_plans(capsys, tmp_path, catalog):
    from gpuwise.plan.endpoint import serving_plan
    from gpuwise.plan.traffic import targets, traffic

    out = launch(capsys, tmp_path, "k8s", "--image", "i", "--rps", "40", "--profile", "chat", "--ttft", "1", "--",
                 "serve", "llama-3.1-8b")  # fmt: skip
    plan = serving_plan("llama-3.1-8b", traffic(rps=40, profile="chat"), targets(1, 0.2, 95), catalog,
                        gpu=None)  # fmt: skip
    names = set(K8S_PRODUCT)
    best = next(o for o in plan["options"] if o.get("cheapest"))
    assert best["gpu"] in names  # the plan's choice is one Kubernetes can name
    f = out["plan"]
    assert (f["accelerator"], f["gpus_per_replica"], f["replicas"]) == (best["gpu"], best["tp"], best["replicas"])
    assert f["goodput_per_replica"] == pytest.approx(best["goodput_per_replica"])
    deployment = next(d for d in yaml.safe_load_all(out["text"]) if d["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert deployment["spec"]["replicas"] == best["replicas"]
    assert command[command.index("--engine") + 1] == "vllm"
    assert command[command.index("--max-seqs") + 1] == str(best["max_seqs"])


@pytest.mark.parametrize("gpu, extra", [("h100-sxm", ["--max-replicas", "6"]), ("cpu", [])])
def test_kubernetes_manifests_validate_and_carry_no_key(capsys, tmp_path, engines_venv, key_file, gpu, extra):
    path, key = key_file
    out = launch(capsys, tmp_path, "k8s", "--gpu", gpu, "--replicas", "2", *extra, "--image", "registry/gpuwise:1",
                 "--api-key-file", str(path), "--", "serve", SMOL, "--max-seqs", "16")  # fmt: skip
    artifact = Path(out["artifact"])
    check = ("import sys, yaml, kubernetes_validate as k\n"
             "for d in yaml.safe_load_all(open(sys.argv[1])):\n"
             f"    k.validate(d, '{K8S_VERSION}', strict=True)\n")  # fmt: skip
    done = subprocess.run([str(engines_venv), "-c", check, str(artifact)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    docs = {d["kind"]: d for d in yaml.safe_load_all(artifact.read_text())}
    assert key not in artifact.read_text()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert docs["Deployment"]["spec"]["replicas"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["env"] == [{"name": "GPUWISE_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": out["plan"] and docs["Deployment"]["metadata"]["name"] + "-key", "key": "api-key"}}},
        # the team's record, where --submit made its Secret (issue #52); optional: else the pod's own
        {"name": "GPUWISE_DB", "valueFrom": {"secretKeyRef": {"name": "gpuwise-record", "key": "url",
                                                             "optional": True}}}]  # fmt: skip
    assert "--api-key" not in " ".join(c["command"]) and "--host" in c["command"]
    # TERM drains within the grace period: preStop, then serve --grace, inside terminationGracePeriodSeconds
    grace = int(c["command"][c["command"].index("--grace") + 1])
    assert pod["terminationGracePeriodSeconds"] > grace + c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    if gpu == "cpu":
        assert "nvidia.com/gpu" not in c["resources"]["limits"] and "HorizontalPodAutoscaler" not in docs
    else:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": K8S_PRODUCT[gpu]}
        hpa = docs["HorizontalPodAutoscaler"]["spec"]
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
        assert hpa["metrics"][0]["pods"]["metric"]["name"] == "gpuwise_num_requests_running"
    # an existing Secret, by name
    out = launch(capsys, tmp_path, "k8s", "--gpu", gpu, "--image", "i", "--key-secret", "team-key", "--", "serve", SMOL)
    env = next(d for d in yaml.safe_load_all(out["text"]) if d["kind"] == "Deployment")
    assert env["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "team-key"


def test_skypilot_loads_the_service_and_its_policy_and_probe_match_the_plan(capsys, tmp_path, engines_venv, key_file):
    path, key = key_file
    out = launch(capsys, tmp_path, "skypilot", "--rps", "40", "--profile", "chat", "--max-replicas", "8",
                 "--api-key-file", str(path), "--", "serve", "llama-3.1-8b")  # fmt: skip
    artifact = Path(out["artifact"])
    assert key not in artifact.read_text()
    read = ("import json, os, sys, tempfile\n"
            "os.environ['HOME'] = tempfile.mkdtemp()\n"
            "import sky\n"
            "t = sky.Task.from_yaml(sys.argv[1]); s = t.service\n"
            "r = list(t.resources)[0]\n"
            "print(json.dumps({'path': s.readiness_path, 'min': s.min_replicas, 'max': s.max_replicas,\n"
            "  'qps': s.target_qps_per_replica, 'acc': r.accelerators, 'ports': r.ports,\n"
            "  'secrets': [r.name for r in t.managed_secret_refs], 'run': t.run}))\n")  # fmt: skip
    done = subprocess.run([str(engines_venv), "-c", read, str(artifact)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    f = out["plan"]
    assert got["path"] == "/readyz"
    assert (got["min"], got["max"]) == (f["replicas"], 8)
    assert got["qps"] == pytest.approx(f["goodput_per_replica"], rel=1e-3)
    assert got["acc"] == {SKY_NAME[f["accelerator"]]: f["gpus_per_replica"]} and got["ports"] == ["8000"]
    # a secret with no value: SkyPilot takes it from `sky serve up --secret GPUWISE_API_KEY`'s environment
    assert got["secrets"] == ["GPUWISE_API_KEY"] and "--api-key" not in got["run"]


# --- a real endpoint: how the Slurm and Ray tests check one -----------------------------------------------------


def answers_and_drains(record_id: int, artifact: Path, capsys, monkeypatch, timeout: float = 300) -> None:
    """The endpoint of `record_id` answers the official openai client with a stream at the address its record
    holds, with the key no artifact and no command line shows; `gpuwise chat ID` and the ui's Models page
    (`gpuwise ui --endpoint ID`) reach it; and `gpuwise launch --stop ID` mid-stream lets that stream end whole."""
    import io
    import time

    import openai

    from gpuwise.errors import GpuwiseError
    from gpuwise.launch.status import endpoint_of

    deadline = time.monotonic() + timeout
    while True:
        try:
            url, key = endpoint_of(record_id)
            break
        except GpuwiseError as e:
            assert "no address" in str(e) and time.monotonic() < deadline, str(e)
            time.sleep(2)
    assert key and key not in artifact.read_text()
    for proc in Path("/proc").iterdir():  # every process's command line, the server's included
        try:
            args = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        assert key.encode() not in args, args
    client = openai.OpenAI(base_url=url, api_key=key)
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\n"))
    assert main(["chat", str(record_id), "--max-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()  # an answer, from the endpoint found by its id
    # the ui's Models page, given the record id (gpuwise ui --endpoint ID), reaches it with its key
    import asyncio

    from gpuwise.ui.endpoints import describe, parse_endpoints

    (ep,) = parse_endpoints([str(record_id)], None)
    assert ep.key == key and asyncio.run(describe(ep, 0))["chat"] == [SMOL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong").models.list()
    stream = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Tell a story."}],
                                            max_tokens=48, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    tokens, finish = 0, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            tokens += 1
            if tokens == 3:  # mid-stream: the engine is told to stop the endpoint
                assert main(["launch", "--stop", str(record_id)]) == 0, capsys.readouterr().err
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "length" and tokens >= 40  # drained: the stream ended whole, not cut
    while endpoint_has_address(record_id):  # the replica withdraws its address as it stops
        assert time.monotonic() < deadline + 60, "the endpoint still announces an address after --stop"
        time.sleep(1)


def endpoint_has_address(record_id: int) -> bool:
    from gpuwise.errors import GpuwiseError
    from gpuwise.launch.status import endpoint_of

    try:
        endpoint_of(record_id)
    except GpuwiseError:
        return False
    return True


def test_serve_takes_its_key_from_a_file_and_refuses_before_loading(capsys, tmp_path, key_file):
    from gpuwise.files import read_key_file

    path, key = key_file
    assert read_key_file(path) == key  # its first line, without the newline
    for argv, words in (
        (["--api-key", "k", "--api-key-file", str(path)], "give the key once"),
        (["--api-key-file", str(tmp_path / "missing")], "cannot read it"),
        (["--api-key-file", str(path), "--announce", str(tmp_path / "no" / "where.json")], "folder does not exist"),
    ):
        assert main(["serve", SMOL, "--host", "0.0.0.0", "--port", "0", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err


def fake_client(where: Path, name: str, answer: str = "") -> Path:
    """A stand-in for an engine's client on PATH: it logs its arguments and GPUWISE_API_KEY, and answers."""
    where.mkdir(exist_ok=True)
    script = where / name
    script.write_text(f'#!/bin/sh\necho "$0 $* | env=${{GPUWISE_API_KEY:-}}" >> {where}/calls\nprintf "{answer}"\n')
    script.chmod(0o755)
    return where / "calls"


@pytest.mark.parametrize("engine", ["k8s", "skypilot"])
def test_submit_hands_the_key_by_file_or_environment_never_by_argument(capsys, tmp_path, monkeypatch, key_file,
                                                                       engine):  # fmt: skip
    """kubectl and sky are not here: stand-ins log what gpuwise hands them. The key reaches the Secret by its
    file's path, SkyPilot by the environment of `sky serve up`; --stop ends the endpoint through the same client."""
    path, key = key_file
    bin_dir = tmp_path / "bin"
    calls = fake_client(bin_dir, "kubectl" if engine == "k8s" else "sky")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    extra = ["--image", "registry/gpuwise:1"] if engine == "k8s" else []
    assert main(["launch", engine, "--gpu", "l4", "--submit", "--api-key-file", str(path), *extra, "--json", "--",
                 "serve", SMOL]) == 0, capsys.readouterr().err  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    logged = calls.read_text().splitlines()
    assert all(key not in line.split(" | ")[0] for line in logged)  # never an argument
    name = out["job_id"]  # the endpoint's name on the engine
    if engine == "k8s":
        assert f"create secret generic {name}-key --from-file=api-key={path.resolve()}" in logged[0]
        assert f"apply -f {out['artifact']}" in logged[1]
    else:
        assert f"serve up -y -n {name}" in logged[0] and "--secret GPUWISE_API_KEY" in logged[0]
        assert logged[0].endswith(f"env={key}")  # the value, from sky's environment
    assert main(["launch", "--stop", str(out["record_id"])]) == 0
    stop = calls.read_text().splitlines()[len(logged):]
    if engine == "k8s":
        assert f"delete deployment,service,hpa -l gpuwise/endpoint={name}" in stop[0] and "delete secret" in stop[1]
    else:
        assert f"serve down -y {name}" in stop[0]
