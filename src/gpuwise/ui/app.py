"""`gpuwise ui`: the planner, the runs, the bench and the served models in a browser, from one local process.

The page (static/index.html, app.js, app.css: no framework, no CDN, nothing fetched from the internet) calls
this JSON API, and the API calls what the CLI calls: `plan_for` (= `gpuwise plan --json`, unrecorded), the run
record (`gpuwise runs`), a run directory's metrics.jsonl and report (`gpuwise report`), and the running
`gpuwise serve` endpoints it was given (ui/endpoints.py). No figure is computed
twice, so the page and the CLI agree (tests/test_ui.py). Bad input is a 400 with the CLI's one line and the
field it is about; nothing a user types gives a 5xx.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from gpuwise.errors import GpuwiseError

STATIC = Path(__file__).parent / "static"


class FieldError(GpuwiseError):
    """Bad input about one field of the form: the page shows it beside that field."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def _field_of(message: str) -> str | None:
    """The form field a CLI message is about: its first --flag, as the form names it."""
    for word in message.replace("(", " ").replace(",", " ").split():
        if word.startswith("--") and len(word) > 2:
            name = word[2:].rstrip(".:;'\"").replace("-", "_")
            return "model" if name in ("model", "workload", "module") else name
    return None


def plan_request(params: dict[str, str]):
    """The form's query string as a PlanRequest, its fields under `gpuwise plan`'s names (dashes for
    underscores), unset ones at the request's own defaults: each number parsed here, each range checked by
    the planner."""
    from dataclasses import fields

    from gpuwise.plan.request import PlanRequest

    # the field's type as written ("int | None", "float | None", "str", "bool"): its first word says how to parse
    kinds = {f.name: str(f.type).split()[0] for f in fields(PlanRequest)}
    values: dict[str, Any] = {}
    for name, raw in params.items():
        raw = raw.strip()
        if not raw or kinds.get(name) not in ("int", "float", "str"):
            continue
        flag = "--" + name.replace("_", "-")
        if kinds[name] == "int":
            try:
                values[name] = int(raw)
            except ValueError:
                raise FieldError(name, f"{flag} must be a whole number, not '{raw[:40]}'") from None
        elif kinds[name] == "float":
            try:
                values[name] = float(raw)
            except ValueError:
                raise FieldError(name, f"{flag} must be a number, not '{raw[:40]}'") from None
            if not math.isfinite(values[name]):
                raise FieldError(name, f"{flag} must be a finite number, not '{raw[:40]}'")
        else:
            values[name] = raw
    values["flash_attention"] = params.get("flash_attention", "true").lower() not in ("false", "0", "off", "no")
    return PlanRequest(**values)


COOKIE = b"gpuwise_key"


class KeyGuard:
    """`gpuwise serve`'s rule: with a key set, every data path (/api, a run's report) needs it, as a header
    or as the cookie the page sets once the user typed it. The page itself (/, /static) holds no data."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        from gpuwise.serve.app import key_matches

        path = scope.get("path", "")
        page = path == "/" or path.startswith("/static/")
        if scope["type"] == "http" and not page and not key_matches(scope["headers"], self.key, cookie=COOKIE):
            body = json.dumps({"error": "missing or wrong API key", "field": "key"}).encode()
            headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def create_app(
    catalog_files: list[Path] | None = None,
    runs_dir: Path = Path("runs"),
    key: str | None = None,
    endpoints: list | None = None,
):
    """The ASGI app `gpuwise ui` serves; `key`: required on every data path when set; `endpoints`: running
    `gpuwise serve` processes (ui.endpoints.Endpoint) the Models page talks to."""
    app = _app(catalog_files, runs_dir, endpoints or [])
    return KeyGuard(app, key) if key else app


def _app(catalog_files: list[Path] | None, runs_dir: Path, endpoints: list) -> FastAPI:
    from gpuwise.hardware.catalog import load_catalog

    load_catalog(catalog_files)  # a broken --catalog is one line at start, not a 400 on every plan
    app = FastAPI(title="gpuwise ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.exception_handler(GpuwiseError)
    async def _refused(request: Request, e: GpuwiseError) -> JSONResponse:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        field = e.field if isinstance(e, FieldError) else _field_of(message)
        model = request.query_params.get("model", "").strip()
        if field is None and model and model in message:  # the model file or name could not be read
            field = "model"
        return JSONResponse({"error": message, "field": field}, status_code=400)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/options")
    def options() -> dict[str, Any]:
        from gpuwise.plan.presets import PRESETS
        from gpuwise.plan.request import TASKS

        catalog = load_catalog(catalog_files)
        return {
            "presets": sorted(PRESETS),
            "tasks": list(TASKS),
            "precisions": ["bf16", "fp16", "fp8", "fp32"],
            "optimizers": ["adamw", "adamw-8bit", "sgd"],
            "checkpointing": ["none", "selective", "full"],
            "gpus": [
                {"slug": a.slug, "name": a.name, "memory_gb": a.mem_gb}
                for a in sorted(catalog.accelerators.values(), key=lambda a: a.slug)
                if a.kind != "cpu"
            ],
            "providers": sorted({p.provider for p in catalog.cloud}),
        }

    @app.get("/api/plan")
    def plan(request: Request) -> JSONResponse:
        from gpuwise.files import to_json
        from gpuwise.plan.planner import plan_for

        params = dict(request.query_params)
        model = params.get("model", "").strip()
        if not model:
            raise FieldError("model", "give a model: a preset, a model directory, a .gguf file or a config.json")
        result, warning = plan_for(model, plan_request(params), load_catalog(catalog_files))
        if warning:
            result["warnings"] = [warning, *result.get("warnings", [])]
        return JSONResponse(json.loads(to_json(result)))  # inf and nan as null, as `plan --json` prints them

    @app.get("/api/runs")
    def runs(workload: str = "", status: str = "") -> list[dict[str, Any]]:
        from gpuwise.ui.records import run_rows

        return [
            r
            for r in run_rows(runs_dir)
            if (not workload or r["workload"] == workload) and (not status or r["status"] == status)
        ]

    @app.get("/api/runs/{key}")
    def run(key: str) -> JSONResponse:
        from gpuwise.files import to_json
        from gpuwise.ui.records import run_detail

        return JSONResponse(json.loads(to_json(run_detail(key, runs_dir))))

    @app.get("/runs/{key}/report", response_class=HTMLResponse)
    def report(key: str) -> HTMLResponse:
        from gpuwise.report.html import run_report
        from gpuwise.ui.records import run_path

        return HTMLResponse(run_report(run_path(key, runs_dir)))

    @app.get("/api/bench")
    def bench() -> JSONResponse:
        from gpuwise.files import to_json
        from gpuwise.ui.records import bench_rows

        return JSONResponse(json.loads(to_json(bench_rows())))

    @app.get("/api/models")
    async def models() -> dict[str, Any]:
        import asyncio

        from gpuwise.ui.endpoints import describe, servable

        found = await asyncio.gather(*(describe(ep, i) for i, ep in enumerate(endpoints)))
        return {"servable": await asyncio.to_thread(servable, runs_dir), "endpoints": list(found)}

    @app.api_route("/api/endpoints/{index}/{path:path}", methods=["GET", "POST"])
    async def endpoint(index: int, path: str, request: Request):
        from gpuwise.ui.endpoints import MAX_BODY, forward

        if not 0 <= index < len(endpoints):
            return JSONResponse({"error": f"no endpoint #{index}: start gpuwise ui with --endpoint URL"}, 404)
        length = request.headers.get("content-length") or "0"
        if not (length.isascii() and length.isdigit()):  # int() would take other scripts' digits
            return JSONResponse({"error": f"Content-Length {length[:40]!r} is not a number", "field": None}, 400)
        if int(length) > MAX_BODY:
            return JSONResponse({"error": f"larger than {MAX_BODY >> 20} MB", "field": "file"}, 413)
        body = await request.body()
        return await forward(endpoints[index], request.method, path, body, request.headers.get("content-type"))

    return app
