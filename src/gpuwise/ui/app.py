"""`gpuwise ui`: the planner, the runs, the bench and the served models in a browser, from one local process.

The page (static/index.html, app.js, app.css: no framework, no CDN, nothing fetched from the internet) calls
this JSON API, and the API calls what the CLI calls: `plan_for` (= `gpuwise plan --json`, unrecorded) and
`serving_plan` (= `gpuwise plan --task serve --json`, unrecorded), the run
record (`gpuwise runs`), a run directory's metrics.jsonl and report (`gpuwise report`), and the running
`gpuwise serve` endpoints it was given (ui/endpoints.py). No figure is computed
twice, so the page and the CLI agree (tests/test_ui.py). Bad input is a 400 with the CLI's one line and the
field it is about; nothing a user types gives a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from gpuwise.errors import GpuwiseError
from gpuwise.files import to_json
from gpuwise.fleet.view import Ask as FleetAsk
from gpuwise.fleet.view import build as build_fleet
from gpuwise.hardware.catalog import load_catalog
from gpuwise.plan.endpoint import serving_plan
from gpuwise.plan.planner import plan_for
from gpuwise.plan.presets import PRESETS
from gpuwise.plan.request import TASKS, PlanRequest
from gpuwise.plan.traffic import DEFAULT_HOURS_PER_DAY, DEFAULT_TARGETS, PROFILES, targets, traffic
from gpuwise.report.html import run_report
from gpuwise.serve.app import Guard
from gpuwise.serve.hosts import WebPolicy
from gpuwise.serve.hosts import allowed_hosts as names
from gpuwise.ui.endpoints import MAX_BODY, describe, forward, servable
from gpuwise.ui.records import bench_rows, run_detail, run_path, run_rows
from gpuwise.workloads.serving import Limits

STATIC = Path(__file__).parent / "static"


class FieldError(GpuwiseError):
    """Bad input about one field of the form: the page shows it beside that field."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


# The lines that name no flag but a thing the form has a field for.
UNKNOWN = {"unknown model": "model", "unknown profile": "profile", "unknown accelerator": "gpu"}


def _field_of(message: str) -> str | None:
    """The form field a CLI message is about: its first --flag that is a field of the form, as the form names
    it (a "see `gpuwise plan --help`" is none)."""
    for start, field in UNKNOWN.items():
        if message.startswith(start):
            return field
    for word in message.replace("(", " ").replace(",", " ").split():
        if word.startswith("--") and len(word) > 2:
            name = word[2:].rstrip(".:;'\"`)").replace("-", "_")
            if name in ("model", "workload", "module"):
                return "model"
            if name in FORM_FIELDS:
                return name
    return None


def _run_key(key: str) -> str:
    """A run's page key: a record id in ASCII digits, or a run directory's name ('٣' is neither: int() would
    read it as record 3)."""
    if key.isdigit() and not key.isascii():
        raise FieldError(None, f"run '{key[:40]}': a record id is written in ASCII digits (0-9)")
    if key.isdigit() and len(key) > 19:  # past SQLite's 64-bit ids, and past what int() takes (4,300 digits)
        raise FieldError(None, f"run '{key[:40]}...': no record has an id that long")
    return key


def _number(name: str, raw: str, kind: str) -> int | float:
    """A form field's number as `gpuwise plan` takes it, its error under the CLI's flag name."""
    flag = "--" + name.replace("_", "-")
    if kind == "int":
        return ascii_int(raw, flag, name)
    try:
        if not raw.isascii():  # float() also takes other scripts' digits ('٣.٥')
            raise ValueError(raw)
        value = float(raw)
    except ValueError:
        raise FieldError(name, f"{flag} must be a number, not '{raw[:40]}'") from None
    if not math.isfinite(value):
        raise FieldError(name, f"{flag} must be a finite number, not '{raw[:40]}'")
    return value


def plan_request(params: dict[str, str]):
    """The form's query string as a PlanRequest, its fields under `gpuwise plan`'s names (dashes for
    underscores), unset ones at the request's own defaults: each number parsed here, each range checked by
    the planner."""
    # the field's type as written ("int | None", "float | None", "str", "bool"): its first word says how to parse
    kinds = {f.name: str(f.type).split()[0] for f in fields(PlanRequest)}
    values: dict[str, Any] = {}
    for name, raw in params.items():
        raw = raw.strip()
        if not raw or kinds.get(name) not in ("int", "float", "str"):
            continue
        values[name] = raw if kinds[name] == "str" else _number(name, raw, kinds[name])
    values["flash_attention"] = params.get("flash_attention", "true").lower() not in ("false", "0", "off", "no")
    return PlanRequest(**values)


# The serving form's fields: `gpuwise plan --task serve`'s flags, with how each is parsed.
SERVE_FIELDS = {
    "rps": "float",
    "users": "float",
    "requests_per_user_hour": "float",
    "prompt_tokens": "int",
    "output_tokens": "int",
    "ttft": "float",
    "tpot": "float",
    "percentile": "float",
    "hours_per_day": "float",
    "efficiency": "float",
}


# Every field of the plan page's form (the training form's and the serving form's), by its query name.
FORM_FIELDS = {f.name for f in fields(PlanRequest)} | set(SERVE_FIELDS) | {"profile", "gpu", "precision", "task"}


def serving_plan_of(model: str, params: dict[str, str], catalog) -> dict[str, Any]:
    """The serving form as `gpuwise plan --task serve --json` takes its flags (unset ones at the CLI's defaults),
    and the plan it prints."""
    v: dict[str, Any] = {
        k: _number(k, raw.strip(), kind) for k, kind in SERVE_FIELDS.items() if (raw := params.get(k, "")).strip()
    }
    demand = traffic(
        v.get("rps"),
        v.get("users"),
        v.get("requests_per_user_hour"),
        v.get("prompt_tokens"),
        v.get("output_tokens"),
        params.get("profile", "").strip() or None,
    )
    d = DEFAULT_TARGETS
    goal = targets(v.get("ttft", d.ttft), v.get("tpot", d.tpot), v.get("percentile", d.percentile))
    return serving_plan(
        model,
        demand,
        goal,
        catalog,
        params.get("precision", "").strip() or "bf16",
        v.get("hours_per_day", DEFAULT_HOURS_PER_DAY),
        params.get("gpu", "").strip() or None,
        v.get("efficiency"),
    )


COOKIE = b"gpuwise_key"
FORWARDS = "/api/endpoints/"  # the paths that act for the page: its chats and images, sent on to an endpoint


def _is_page(path: str) -> bool:
    """The page itself (/, /static) holds no data: it loads without a key, and asks for one."""
    return path == "/" or path.startswith("/static/")


def _error(status: int, message: str, headers: dict[str, str]) -> JSONResponse:
    """The ui's own answers' shape, {"error": line, "field": the form field or None}, which the page shows."""
    return JSONResponse({"error": message, "field": "key" if status == 401 else None}, status, headers or None)


def ascii_int(raw: str, what: str, field: str | None = None) -> int:
    """A whole number a user typed or a path holds, in ASCII digits only: int() also takes '٣' and '３'."""
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 4000:  # int() refuses over 4,300 digits
        raise FieldError(field, f"{what} must be a whole number, not '{raw[:40]}'")
    return int(text)


class Ui(Guard):
    """The ui's ASGI app: serve's Guard (Host and Origin, key, body cap and read deadline) around the page's
    API. `token`: the per-launch token made for it, or None."""

    token: str | None = None


def create_app(
    catalog_files: list[Path] | None = None,
    runs_dir: Path = Path("runs"),
    key: str | None = None,
    endpoints: list | None = None,
    *,
    host: str = "127.0.0.1",
    allowed_hosts: list[str] | None = None,
    limits: Limits | None = None,
) -> Ui:
    """The ASGI app `gpuwise ui` serves; `key`: required on every data path when set; `endpoints`: running
    `gpuwise serve` processes (ui.endpoints.Endpoint) the Models page talks to; `host`, `allowed_hosts`: the
    Host names it answers (serve/hosts.py); `limits`: its body cap and read deadline (serve's Limits).

    A ui holding an endpoint's key never lends it to whoever reaches it: without a key of its own it makes a
    per-launch token (as Jupyter does), the returned app's `.token`, required as the key. `gpuwise ui` prints
    the URL with ?token=...; the page's first load with it sets the key cookie, then drops it from the URL."""
    endpoints = endpoints or []
    token = secrets.token_urlsafe(32) if key is None and any(ep.key for ep in endpoints) else None
    key = key or token
    web = WebPolicy(host, names(allowed_hosts), keyed=key is not None, cors_flag=None)
    unauthorized = (
        "missing or wrong token: open the URL gpuwise ui printed (it ends in ?token=...)"
        if token
        else "missing or wrong API key"
    )
    app = Ui(
        _app(catalog_files, runs_dir, endpoints, key),
        key,
        limits or Limits(max_body_bytes=MAX_BODY),
        None,
        web=web,
        error=_error,
        cookie=COOKIE,
        open_path=_is_page,
        forwards=lambda path: path.startswith(FORWARDS),
        unauthorized=unauthorized,
    )
    app.token = token
    return app


@dataclass(frozen=True)
class UiState:
    """What the routes read: the catalog files, the runs directory, the endpoints, and the key."""

    catalog_files: list[Path] | None
    runs_dir: Path
    endpoints: list
    key: str | None


def _state(request: Request) -> UiState:
    return request.app.state.ui


def _app(catalog_files: list[Path] | None, runs_dir: Path, endpoints: list, key: str | None) -> FastAPI:
    load_catalog(catalog_files)  # a broken --catalog is one line at start, not a 400 on every plan
    app = FastAPI(title="gpuwise ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ui = UiState(catalog_files, runs_dir, endpoints, key)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_exception_handler(GpuwiseError, _refused)  # type: ignore[arg-type]
    app.include_router(router)
    return app


async def _refused(request: Request, e: GpuwiseError) -> JSONResponse:
    message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    field = e.field if isinstance(e, FieldError) else _field_of(message)
    model = request.query_params.get("model", "").strip()
    if field is None and model and model in message:  # the model file or name could not be read
        field = "model"
    return JSONResponse({"error": message, "field": field}, status_code=400)


# --- the routes: each a small function over what the CLI calls --------------------------------------------
router = APIRouter()


@router.get("/", include_in_schema=False)
async def index(request: Request) -> Response:
    given, key = request.query_params.get("token"), _state(request).key
    if given is not None and key is not None and hmac.compare_digest(given.encode(), key.encode()):
        # The printed URL's token becomes the key cookie the page's calls carry, and leaves the address
        # bar (and the history) by a redirect to the same page without it.
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        page = RedirectResponse("/" + (f"?{rest}" if rest else ""), 303, headers={"Cache-Control": "no-store"})
        cookie = f"{COOKIE.decode()}={quote(given, safe='')}; Path=/; HttpOnly; SameSite=Strict"
        page.headers.append("set-cookie", cookie)
        return page
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/api/options")
def options(request: Request) -> dict[str, Any]:
    catalog = load_catalog(_state(request).catalog_files)
    return {
        "presets": sorted(PRESETS),
        "tasks": [*TASKS, "serve"],
        "profiles": {name: asdict(p) for name, p in PROFILES.items()},
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


@router.get("/api/plan")
def plan(request: Request) -> JSONResponse:
    params = dict(request.query_params)
    model = params.get("model", "").strip()
    if not model:
        raise FieldError("model", "give a model: a preset, a model directory, a .gguf file or a config.json")
    catalog = load_catalog(_state(request).catalog_files)
    if params.get("task", "").strip() == "serve":  # the serving form: `gpuwise plan --task serve`
        return _json(serving_plan_of(model, params, catalog))
    result, warning = plan_for(model, plan_request(params), catalog)
    if warning:
        result["warnings"] = [warning, *result.get("warnings", [])]
    return _json(result)


@router.get("/api/runs")
def runs(request: Request, workload: str = "", status: str = "") -> list[dict[str, Any]]:
    return [
        r
        for r in run_rows(_state(request).runs_dir)
        if (not workload or r["workload"] == workload) and (not status or r["status"] == status)
    ]


@router.get("/api/runs/{run}")
def run(request: Request, run: str) -> JSONResponse:
    return _json(run_detail(_run_key(run), _state(request).runs_dir))


@router.get("/runs/{run}/report", response_class=HTMLResponse)
def report(request: Request, run: str) -> HTMLResponse:
    return HTMLResponse(run_report(run_path(_run_key(run), _state(request).runs_dir)))


@router.get("/api/bench")
def bench() -> JSONResponse:
    return _json(bench_rows())


@router.get("/api/fleet")
def fleet(request: Request, since: str = "30d", by: str = "team") -> JSONResponse:
    """`gpuwise fleet --json`'s figures, with its charts' series: what the Fleet page draws."""
    return _json(build_fleet(FleetAsk(since=since, by=by), load_catalog(_state(request).catalog_files)))


@router.get("/api/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    found = await asyncio.gather(*(describe(ep, i) for i, ep in enumerate(state.endpoints)))
    return {"servable": await asyncio.to_thread(servable, state.runs_dir), "endpoints": list(found)}


@router.api_route("/api/endpoints/{index}/{path:path}", methods=["GET", "POST"])
async def endpoint(request: Request, index: str, path: str):
    endpoints = _state(request).endpoints
    number = ascii_int(index, "an endpoint's number")
    if not 0 <= number < len(endpoints):
        return JSONResponse({"error": f"no endpoint #{index}: start gpuwise ui with --endpoint URL"}, 404)
    # Guard (serve/app.py) counts the body as it arrives and cuts it off at the ui's cap with a 413, a
    # chunked one too: what is read here is at most that much.
    body = await request.body()
    return await forward(endpoints[number], request.method, path, body, request.headers.get("content-type"))


def _json(result: Any) -> JSONResponse:
    return JSONResponse(json.loads(to_json(result)))  # inf and nan as null, as `--json` prints them
