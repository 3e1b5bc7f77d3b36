"""The Models page: what `gpuwise serve` would serve from here, and the endpoints it serves now.

`gpuwise ui --endpoint URL` (repeatable) names running `gpuwise serve` processes, or, by its record id, an
endpoint `gpuwise launch -- serve` started (its address and key from the record). The page reaches them through
this process rather than directly: a serve endpoint answers no other browser origin unless it was started with
`--cors-origin`, and its API key stays in this process instead of being typed into the page; it is lent to no
one: a ui that holds it requires a key of its own, or the per-launch token it prints (ui/app.py). Only the paths the
page uses are forwarded, the answer streamed through as it comes (a chat reply's server-sent events), and a page
that stops reading (its Stop button, a closed tab) closes the forwarded request, which frees serve's slot.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.launch.status import endpoint_of
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.ui.records import run_rows

# What the page calls on an endpoint: its description, its models, a chat, an image.
FORWARDED = {
    ("GET", "v1/info"),
    ("GET", "v1/models"),
    ("POST", "v1/chat/completions"),
    ("POST", "v1/predict"),
}
# The body cap of `gpuwise ui` (--max-body-mb): an upload this process holds before forwarding, counted as it
# arrives (a chunked one too) by serve's Guard; serve's own --max-body-mb refuses less.
MAX_BODY = 64 << 20
CONNECT_S, READ_S = 5.0, 300.0  # serve bounds each request itself (--timeout); this only stops a hung socket


@dataclass(frozen=True)
class Endpoint:
    url: str  # http://host:port, no trailing slash
    key: str | None = None


def parse_endpoints(urls: list[str], key: str | None) -> list[Endpoint]:
    """`--endpoint` values as endpoints; one line for a value that is not an http(s) URL."""
    out = []
    for url in urls:
        url = url.strip().rstrip("/")
        if url.isdigit():  # a launched endpoint, by its record id: its address and its key from the record
            found, found_key = endpoint_of(int(url))
            out.append(Endpoint(found.removesuffix("/v1"), key or found_key))
            continue
        if url.endswith("/v1"):  # the OpenAI base URL a user may have at hand
            url = url[:-3]
        if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
            raise GpuwiseError(f"--endpoint {url!r}: give the URL `gpuwise serve` printed, e.g. http://127.0.0.1:8000")
        out.append(Endpoint(url, key))
    return out


def servable(runs_dir: Path) -> list[dict[str, Any]]:
    """What `gpuwise serve` would serve from here: every finished run (recorded, or under `runs_dir`), and
    every named base whose package is installed, each with the command that serves it."""
    rows = [
        {
            "name": Path(r["run_dir"]).name,
            "kind": r["workload"],
            "path": r["run_dir"],
            "command": f"gpuwise serve {r['run_dir']}",
        }
        for r in run_rows(runs_dir)
        if r["status"] == "finished" and r["run_dir"] and Path(r["run_dir"]).is_dir()
    ]
    for name, base in NAMED_BASES.items():
        try:
            path = str(named_base_path(name))
        except GpuwiseError:  # its package is not installed: not servable here
            continue
        rows.append(
            {"name": name, "kind": f"named base ({base.source})", "path": path, "command": f"gpuwise serve {name}"}
        )
    return rows


def _headers(ep: Endpoint, content_type: str | None = None) -> dict[str, str]:
    headers = {"authorization": f"Bearer {ep.key}"} if ep.key else {}
    if content_type:
        headers["content-type"] = content_type
    return headers


def _message(body: bytes, status: int) -> str:
    """The one line an endpoint's error answer carries (OpenAI's shape, or FastAPI's "detail")."""
    try:
        data = json.loads(body)
        err = data.get("error", data.get("detail"))
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return f"answered {status}"


async def describe(ep: Endpoint, index: int) -> dict[str, Any]:
    """An endpoint as the page shows it: its /v1/info, the model ids it answers chats for, and whether it takes
    images; or why it could not be reached."""
    import httpx

    out: dict[str, Any] = {"index": index, "url": ep.url, "up": False, "chat": [], "images": False}
    async with httpx.AsyncClient(timeout=httpx.Timeout(CONNECT_S)) as client:
        try:
            info = await client.get(f"{ep.url}/v1/info", headers=_headers(ep))
            if info.status_code != 200:
                out["error"] = f"{ep.url}/v1/info: {_message(info.content, info.status_code)}"
                return out
            out.update(up=True, info=info.json())
            # what it can do, read from its own OpenAPI document rather than from the workload's name
            schema = await client.get(f"{ep.url}/openapi.json", headers=_headers(ep))
            paths = schema.json().get("paths", {}) if schema.status_code == 200 else {}
            out["images"] = "/v1/predict" in paths and "multipart/form-data" in json.dumps(paths["/v1/predict"])
            if "/v1/chat/completions" in paths:
                models = await client.get(f"{ep.url}/v1/models", headers=_headers(ep))
                out["chat"] = [m["id"] for m in models.json().get("data", [])] if models.status_code == 200 else []
        except httpx.HTTPError as e:
            out["error"] = f"{ep.url} is not answering ({type(e).__name__})"
        except (ValueError, AttributeError, KeyError, TypeError):  # JSON, but not serve's
            out.update(up=False, error=f"{ep.url} answers, but not as `gpuwise serve` does")
    return out


async def forward(ep: Endpoint, method: str, path: str, body: bytes, content_type: str | None):
    """One of the page's calls passed on to the endpoint, its answer streamed back with status and type."""
    import httpx
    from fastapi.responses import JSONResponse, StreamingResponse

    if (method, path) not in FORWARDED:
        return JSONResponse({"error": f"{method} /{path} is not a path the page forwards", "field": None}, 404)
    client = httpx.AsyncClient(timeout=httpx.Timeout(CONNECT_S, read=READ_S))
    request = client.build_request(method, f"{ep.url}/{path}", content=body, headers=_headers(ep, content_type))
    try:
        answer = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        return JSONResponse({"error": f"{ep.url} is not answering ({type(e).__name__})", "field": None}, 502)

    async def relay() -> AsyncIterator[bytes]:
        # Closing here (also when the page goes away and Starlette cancels this generator) closes the
        # connection to serve, which sees the disconnect and frees the sequence's slot within a step.
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()
            await client.aclose()

    keep = ("content-type", "retry-after", "x-accel-buffering", "cache-control")
    headers = {k: v for k in keep if (v := answer.headers.get(k))}
    return StreamingResponse(relay(), status_code=answer.status_code, headers=headers)
