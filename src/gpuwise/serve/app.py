"""The HTTP API around a served workload: its key, its limits, its metrics, /health and /v1/info, and
the dynamic batcher; the workload adds its own routes (`Served.routes`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from gpuwise.errors import GpuwiseError
from gpuwise.files import read_run_file, to_json, write_atomic
from gpuwise.hardware.usage import Sampler, probe_for, usage_gauges
from gpuwise.results import TrainSummary
from gpuwise.serve.batcher import DynamicBatcher, ServeMetrics
from gpuwise.serve.hosts import WebPolicy, allowed_hosts
from gpuwise.serve.llm.protocol import error_body
from gpuwise.workloads.serving import ClientError, Limits, ServeContext

log = logging.getLogger("gpuwise.serve")


@dataclass
class Settings:
    run_dir: str
    runtime: str = "torch"
    max_batch: int = 32
    max_wait_ms: float = 5.0
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    cors_origins: list[str] = field(default_factory=list)  # browser origins allowed to call the API
    host: str = "127.0.0.1"  # the address it is bound to: a Host the server answers (serve/hosts.py)
    allowed_hosts: list[str] = field(default_factory=list)  # other Host names it answers (--allowed-host)

    def __post_init__(self):
        self.limits = self.limits or Limits()  # an explicit None still means the defaults


class Info(BaseModel):
    workload: str
    model: str
    device: str
    precision: str
    run_id: str
    runtime: str
    max_batch: int
    max_wait_ms: float
    limits: dict
    steps: int | None = Field(None, description="optimizer steps the served run was trained for (its summary.json)")
    eval: dict = Field(default_factory=dict, description="the run's held-out metrics, as `gpuwise train` scored them")
    serving: dict | None = Field(
        None,
        description="a language model's serving plan: context, KV bytes a token, KV budget (tokens), slots, the "
        "goodput planned at the default targets (null where not planned), and the engine line (which engine, why, "
        "its compute threads on a CPU)",
    )


def _error(status: int, message: str, **headers) -> JSONResponse:
    """Every error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}), which its client
    and the chat front-ends parse, with the message also under "detail" as gpuwise always answered."""
    return JSONResponse(error_body(status, message), status_code=status, headers=headers or None)


_BEARER = {"WWW-Authenticate": "Bearer"}
# The orchestrator's probes (Kubernetes' httpGet, SkyServe's readiness_probe) carry no key and a Host of a pod's
# address: these two paths answer before the Host and key checks, and say nothing but whether the server is up
# and whether its engine can answer (docs/reliability.md, "Probes").
LIVE, READY = "/livez", "/readyz"


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def key_matches(headers: list[tuple[bytes, bytes]], key: bytes, cookie: bytes | None = None) -> bool:
    """Whether a request carries `key`: as X-API-Key, as `Authorization: Bearer`, or (for a browser page's
    links, which send no header) as the cookie named `cookie`."""
    given = b""
    for name, value in headers:
        if name == b"x-api-key":
            given = value
        elif name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:]  # the scheme is case-insensitive (RFC 9110); a bare key is not a bearer token
        elif cookie and name == b"cookie" and not given:
            for part in value.split(b";"):
                k, _, v = part.strip().partition(b"=")
                given = unquote_to_bytes(v) if k == cookie else given  # the page sets it URL-encoded
    return hmac.compare_digest(given, key)  # constant time: no timing oracle on the key


class Guard:
    """The outermost layer of every request of `gpuwise serve` and `gpuwise ui`, as plain ASGI (no
    BaseHTTPMiddleware, which would hide a client's disconnect from the routes): the Host and Origin rules
    (serve/hosts.py), the API key, the body's size (counted as it arrives, a wrong or absent Content-Length
    too) and its read time, and the request metrics, a 500 included.

    `error(status, message, headers)`: the answer's shape (serve's is OpenAI's; the ui's is its own);
    `cookie`: the cookie that may carry the key (the ui's page); `open_path(path)`: paths that need no key (the
    ui's page, which holds no data); `forwards(path)`: paths that act even on a GET (the ui's forwarding)."""

    def __init__(
        self,
        app,
        key: str | None,
        limits: Limits,
        metrics: ServeMetrics | None,
        cors: bool = False,
        *,
        web: WebPolicy | None = None,
        error: Callable[..., Any] | None = None,
        cookie: bytes | None = None,
        open_path: Callable[[str], bool] | None = None,
        forwards: Callable[[str], bool] | None = None,
        ready: Callable[[], bool] | None = None,
        unauthorized: str = "missing or wrong API key (X-API-Key or Authorization: Bearer)",
    ):
        self.app, self.limits, self.metrics, self.cors = app, limits, metrics, cors
        # Compared as UTF-8 bytes, as the client sent them: HTTP headers are bytes, and decoding them
        # (Starlette takes latin-1) would never match a non-ASCII key.
        self.key = key.encode("utf-8") if key else None
        self.web = web or WebPolicy(keyed=self.key is not None)
        self.error = error or (lambda status, message, headers: _error(status, message, **headers))
        self.cookie, self.unauthorized = cookie, unauthorized
        self.open_path = open_path or (lambda _: False)
        self.forwards = forwards or (lambda _: False)
        self.ready = ready  # None: no probe paths (the ui)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        assert self.key is not None  # __call__ asks only when a key is set
        return key_matches(headers, self.key, self.cookie)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500
        limits, refused = self.limits, None

        async def reply(code: int, message: str, **headers) -> None:
            nonlocal status
            status = code
            await self.error(code, message, headers)(scope, receive, send)

        path = scope.get("path", "")
        if self.ready is not None and path in (LIVE, READY):
            code = await self._probe(path, scope, send)
            return self._count(scope, start, code, "probe")
        # Which page sent it, before the key: a rebinding page learns nothing, not even that a key is asked.
        web = self.web.refusal(scope, self.forwards(path))
        if web is not None:
            await reply(*web)
            return self._count(scope, start, web[0], "any")
        # A browser's CORS preflight (OPTIONS) carries no key by design; the CORS middleware answers it.
        preflight = self.cors and scope.get("method") == "OPTIONS"
        needs_key = self.key is not None and not preflight and not self.open_path(path)
        if needs_key and not self._authorized(scope["headers"]):
            await reply(401, self.unauthorized, **_BEARER)
            return self._count(scope, start, 401, "any")
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = f"request body over the limit of {limits.max_body_bytes:,} bytes"
        if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
            await reply(413, too_large)
            return self._count(scope, start, 413)
        loop = asyncio.get_running_loop()
        deadline, seen, body_done, started = loop.time() + limits.read_timeout_s, 0, False, False

        async def counted():
            nonlocal seen, body_done, refused
            if body_done:  # later reads wait for the client to leave (streaming responses): no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                refused = _Refused(408, f"request body not received within {limits.read_timeout_s:g} s")
                raise refused from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limits.max_body_bytes:
                    refused = _Refused(413, too_large)
                    raise refused
            return message

        async def watched(message):
            nonlocal started, status
            if message["type"] == "http.response.start":
                if refused is not None:  # FastAPI turned our refusal into "error parsing the body": say ours
                    raise refused
                started, status = True, message["status"]
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _Refused as e:
            if not started:
                await reply(e.status, e.message)
        except Exception:  # noqa: BLE001 - a bug of ours: logged, counted, and one JSON line to the client
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if self.metrics is not None:
                self.metrics.internal_errors.inc()
            status = 500
            if not started:
                await reply(500, "internal error (logged by the server)")
        self._count(scope, start, status)

    async def _probe(self, path: str, scope, send) -> int:
        """200 or 503 and one word: nothing of the model, the engine's error or the server's settings."""
        if scope.get("method") not in ("GET", "HEAD"):
            code, body = 405, {"status": "GET or HEAD"}
        elif path == LIVE:
            code, body = 200, {"status": "live"}
        else:
            up = self.ready is not None and self.ready()
            code, body = (200, {"status": "ready"}) if up else (503, {"status": "not ready"})
        response = JSONResponse(body, status_code=code, headers={"Cache-Control": "no-store"})
        await response(scope, _no_body, send)
        return code

    def _count(self, scope, start: float, status: int, endpoint: str | None = None) -> None:
        if self.metrics is None:  # the ui keeps no metrics
            return
        route = scope.get("route")  # the route's template, so a scan of random paths adds no series
        endpoint = endpoint or getattr(route, "path", "unmatched")
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if endpoint != "any":  # refused before any route: counted, not timed (as the 401 always was)
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


async def _no_body():
    return {"type": "http.request", "body": b"", "more_body": False}


def _trained(run_dir: str) -> TrainSummary | None:
    """The served run's summary (read through the typed result), or None where it cannot be read."""
    import json
    from pathlib import Path

    try:
        return TrainSummary.load(json.loads(read_run_file(Path(run_dir) / "summary.json", "run summary", "JSON")))
    except (GpuwiseError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def create_app(served, settings: Settings, run_id: str, precision: str, on_stop=None, usage_file: Path | None = None):
    """The server's app over `served`; `on_stop(usage)` runs once it has stopped serving (its engines closed), with
    the devices' use over its life (hardware/usage.py), which /metrics exports as it goes and `usage_file` keeps."""
    limits, metrics = settings.limits, ServeMetrics()
    probe, note = probe_for(str(served.device))
    if note:
        log.warning(note)
    usage = Sampler(probe, on_flush=(lambda s: write_atomic(usage_file, to_json(s) + "\n", "usage file"))
                    if usage_file else None)  # fmt: skip
    usage_gauges(metrics.registry, usage, run_id)
    batcher = DynamicBatcher(served, settings.max_batch, settings.max_wait_ms, metrics)
    # Image decoding takes seconds for large images: off the event loop, on as many threads as cores
    # (Pillow releases the GIL while it decodes), so /health and other requests are not held up.
    decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuwise-decode")

    @contextlib.asynccontextmanager
    async def lifespan(_):
        usage.start()
        if served.batched:
            await batcher.start()
        yield
        await batcher.stop()
        if hasattr(served, "close"):  # an LLM's engine thread
            served.close()
        decoder.shutdown(wait=False, cancel_futures=True)
        used = usage.stop()
        if on_stop is not None:  # here, not after uvicorn returns: it re-raises SIGTERM once it has shut down
            on_stop(used)

    app = FastAPI(
        title=f"gpuwise serve: {served.workload}",
        description=f"Run {run_id} ({served.model_name}) on {served.device}.",
        lifespan=lifespan,
    )

    @app.exception_handler(ClientError)
    async def client_error(_, e: ClientError):
        return _error(e.status, e.message, **e.headers)

    @app.exception_handler(Exception)
    async def fault(_, e: Exception):  # Starlette answers with this, then re-raises to Guard, which logs and counts
        return _error(500, "internal error (logged by the server)")

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        return _error(422, f"{where}: {first['msg']}")

    async def answer(items: list):
        try:
            return await asyncio.wait_for(batcher.submit(items), limits.timeout_s)
        except TimeoutError:
            raise ClientError(504, f"no answer within the {limits.timeout_s:g} s request timeout") from None

    @app.get("/health")
    async def health() -> dict:
        # an LLM's engine may have stopped (a vLLM process that died): a 503 tells the orchestrator to restart
        if (why := served.health() if hasattr(served, "health") else None) is not None:
            raise ClientError(503, why)
        return {"status": "ok", "workload": served.workload}

    trained = _trained(settings.run_dir)

    @app.get("/v1/info", response_model=Info)
    async def info() -> Info:
        return Info(
            workload=served.workload,
            model=served.model_name,
            device=served.device + (" (onnxruntime)" if settings.runtime == "onnx" else ""),
            precision=precision,
            run_id=run_id,
            runtime=settings.runtime,
            max_batch=settings.max_batch,
            max_wait_ms=settings.max_wait_ms,
            limits=asdict(limits),
            steps=trained.steps if trained else None,
            eval=trained.eval if trained else {},
            serving=asdict(served.backends[0].serving)
            | {"goodput": served.startup, "engine": served.engine_line, "weights": _weights(served)}
            if hasattr(served, "backends")
            else None,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    served.routes(ServeContext(app, limits, answer, decoder, metrics.internal_errors, log, metrics.registry))
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    web = WebPolicy(
        settings.host, allowed_hosts(settings.allowed_hosts), tuple(settings.cors_origins), bool(settings.api_key)
    )

    def ready() -> bool:
        return (served.health() if hasattr(served, "health") else None) is None

    return Guard(app, settings.api_key, limits, metrics, cors=bool(settings.cors_origins), web=web, ready=ready)


def _unavailable_app(max_connections: int):
    """The 503 for a request beyond `--max-connections`, in the error shape of every other answer (OpenAI's),
    with a Retry-After; uvicorn's own is a plain-text "Service Unavailable" no OpenAI client can parse."""
    import json

    body = json.dumps(
        error_body(503, f"server busy: {max_connections} connections are open (the bound); retry in 1 s")
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def unavailable(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return unavailable


def _protocol_with_header_deadline(read_timeout_s: float, max_connections: int):
    """uvicorn's HTTP protocol with a deadline on the request's headers. uvicorn times out an idle
    keep-alive connection only after a response; a client that connects and sends nothing, or one
    header byte every few seconds, would hold its connection forever. Beyond the connection bound it
    answers our 503 instead of uvicorn's plain-text one."""
    from uvicorn.protocols.http.flow_control import service_unavailable
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    unavailable = _unavailable_app(max_connections)

    class Protocol(HttpToolsProtocol):
        _header_timer = None

        def _start_asgi_task(self, cycle, app) -> None:
            # uvicorn swaps in `service_unavailable` before any app or middleware sees the request.
            super()._start_asgi_task(cycle, unavailable if app is service_unavailable else app)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(read_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            waiting = bool(self.pipeline)  # a pipelined request already has its headers
            super().on_response_complete()
            if not waiting and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


def server_config(app, host: str, port: int, limits: Limits, grace: float = 30.0):
    """uvicorn's settings for `gpuwise serve` (and the tests): header and idle deadlines, a bound on open
    connections (uvicorn answers 503 beyond it), and the drain time after SIGTERM."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=_protocol_with_header_deadline(limits.read_timeout_s, limits.max_connections),
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=5,
        # uvicorn's annotation says int, but it only hands the value to asyncio.wait_for, which takes a float.
        timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
    )


def announced_host(host: str) -> str:
    """The name clients reach a server by: the bound address, or, bound to every interface, the node's name
    (or GPUWISE_ANNOUNCE_HOST, which a launcher sets to the address its cluster routes: Ray's node IP)."""
    import os
    import socket

    if host not in ("0.0.0.0", "::", ""):
        return host
    return os.environ.get("GPUWISE_ANNOUNCE_HOST") or socket.gethostname()


def run_server(config, announce: Path | None = None, base_path: str = "") -> None:
    """uvicorn's server, which, once it listens, writes where it serves to `announce` (JSON: url, host, port, pid)
    and removes it when it stops: how a launched endpoint's record learns its address, the port included when
    the OS chose it (--port 0)."""
    import json
    import os

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if announce is None or not self.started:
                return
            port = next(iter(s.getsockname()[1] for srv in self.servers for s in srv.sockets), config.port)
            host = announced_host(config.host)
            shown = f"[{host}]" if ":" in host else host
            body = {"url": f"http://{shown}:{port}{base_path}", "host": host, "port": port, "pid": os.getpid(),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            write_atomic(announce, json.dumps(body) + "\n", "address file")

        async def shutdown(self, sockets=None) -> None:
            if announce is not None:  # no client is sent to a server that is draining
                with contextlib.suppress(OSError):
                    announce.unlink()
            await super().shutdown(sockets)

    Server(config).run()


def _weights(served) -> str:
    """The weights an LLM server's engine holds (gpuwise's: bf16, int8, int4, fp32...; another engine's: its
    precision), as `gpuwise bench --serve` records them beside its measurement."""
    backend = served.backends[0]
    return str(getattr(backend, "weights", None) or getattr(backend, "precision", "") or served.precision)
