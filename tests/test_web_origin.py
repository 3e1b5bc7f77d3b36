"""No web page reaches a local gpuwise server, on a real uvicorn on loopback (`gpuwise serve` in a thread as
tests/serving.py runs it; `gpuwise ui` as a process, as a user starts it): a foreign Host is refused (DNS
rebinding), a page of another origin cannot make either act, the ui lends its endpoints' key to no one without
the token it printed, and the ui's own limits hold (a silent connection, a chunked body over its cap, non-ASCII
digits in its paths)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from serving import Server, trained
from test_serve import raw
from test_ui import launch_ui

from gpuwise.cli import main

FOREIGN = ("evil.example", "evil.example:8000", "0.0.0.0", "127.0.0.1.evil.example", "localhost.evil.example")
LOOPBACK = ("localhost", "LOCALHOST.", "127.0.0.1", "127.0.0.2", "[::1]", "[::ffff:127.0.0.1]")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("origin")
    with pytest.MonkeyPatch.context() as mp:  # a module fixture runs before conftest's private record
        mp.setenv("GPUWISE_DB", str(tmp / "runs.sqlite"))
        return trained(tmp, "recommender")


@pytest.fixture(scope="module")
def keyed(run):
    """serve with a key: the endpoint a ui forwards to, with that key."""
    server = Server(run, api_key="k")
    with server as c:
        c.headers["Authorization"] = "Bearer k"
        yield server.url, c


@pytest.fixture(scope="module")
def open_ui(run, tmp_path_factory):
    """A keyless ui forwarding to a keyless serve, with small limits (1 s to send a request, 1 MB bodies) and
    one more name it answers to."""
    server = Server(run)
    with server:
        env = dict(os.environ, GPUWISE_DB=str(tmp_path_factory.mktemp("uidb") / "runs.sqlite"))
        env.pop("GPUWISE_ENDPOINT_KEY", None)
        env.pop("GPUWISE_API_KEY", None)
        proc, url, token = launch_ui("--endpoint", server.url, "--read-timeout", "1", "--max-body-mb", "1",
                                     "--allowed-host", "gpu-box.lan", env=env)
        assert token is None  # nothing to lend: no token
        yield proc, url
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def token_ui(keyed, tmp_path_factory):
    """`gpuwise ui --endpoint URL` with the endpoint's key (GPUWISE_ENDPOINT_KEY) and no key of its own."""
    env = dict(os.environ, GPUWISE_DB=str(tmp_path_factory.mktemp("uidb") / "runs.sqlite"),
               GPUWISE_ENDPOINT_KEY="k")
    env.pop("GPUWISE_API_KEY", None)
    proc, url, token = launch_ui("--endpoint", keyed[0], env=env)
    yield url, token
    proc.terminate()
    proc.wait(10)


def test_serve_answers_only_its_own_names(run):
    with Server(run) as c:
        port = c.base_url.port
        for host in FOREIGN:
            r = c.get("/health", headers={"Host": host})
            assert r.status_code == 421, (host, r.text)
            error = r.json()["error"]  # OpenAI's shape, as every other error of serve
            assert error["type"] == "invalid_request_error" and "--allowed-host" in error["message"], host
        for host in LOOPBACK:
            assert c.get("/health", headers={"Host": f"{host}:{port}"}).status_code == 200, host
        assert c.get("/health", headers={"Host": "localhost"}).status_code == 200  # no port: any port
        assert 'gpuwise_requests_total{endpoint="any",status="421"} 5.0' in c.get("/metrics").text
        # no Host at all on HTTP/1.1, two of them, one that is not a host: a 400 before any route
        ask = b"GET /health HTTP/1.1\r\nConnection: close\r\n"
        assert raw(port, ask + b"\r\n").startswith(b"HTTP/1.1 400")
        assert raw(port, ask + b"Host: localhost\r\nHost: evil.example\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert raw(port, ask + b"Host: local host\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert raw(port, ask + b"Host: localhost:99999\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_allowed_host_admits_a_name_and_a_wildcard_bind_with_a_key_admits_any(run, capsys):
    with Server(run, allowed_hosts=["GPU-box.lan:8000"]) as c:  # a port given is ignored; case too
        assert c.get("/health", headers={"Host": "gpu-box.lan:1234"}).status_code == 200
        assert c.get("/health", headers={"Host": "other.lan"}).status_code == 421
    # bound to every address (a key required there): the machine's names are not knowable, the key guards
    with Server(run, host="0.0.0.0", api_key="k") as c:
        assert c.get("/health", headers={"Host": "gpu-box.lan", "X-API-Key": "k"}).status_code == 200
        assert c.get("/health", headers={"Host": "gpu-box.lan"}).status_code == 401
    with Server(run, host="0.0.0.0") as c:  # no key (only the API allows it): the list holds
        assert c.get("/health", headers={"Host": "gpu-box.lan"}).status_code == 421
    for bad in ("*", "http://gpu-box.lan/", ""):
        assert main(["serve", str(run), "--allowed-host", bad]) == 2
        err = capsys.readouterr().err
        assert "--allowed-host" in err and err.count("\n") == 1, err
        assert ("DNS rebinding" in err) == (bad == "*"), err  # why a wildcard is no name


def test_a_page_of_another_origin_cannot_make_serve_act(run):
    ask = {"user": "u1", "k": 2}
    with Server(run, cors_origins=["http://chat.example"]) as c:
        own = f"http://127.0.0.1:{c.base_url.port}"
        assert c.post("/v1/recommend", json=ask, headers={"Origin": own}).status_code == 200  # same origin
        assert c.post("/v1/recommend", json=ask, headers={"Origin": "http://chat.example"}).status_code == 200
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{c.base_url.port + 1}",
                       f"http://localhost:{c.base_url.port}"):  # another port, another name: another origin
            r = c.post("/v1/recommend", json=ask, headers={"Origin": origin})
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (origin, r.text)
        assert "--cors-origin" in r.json()["detail"]
        assert c.get("/v1/info", headers={"Origin": "http://evil.example"}).status_code == 403  # reads too
        # a browser that sends no Origin still names the site the request came from
        cross = {"Sec-Fetch-Site": "cross-site"}
        assert c.post("/v1/recommend", json=ask, headers=cross).status_code == 403
        assert c.get("/health", headers=cross).status_code == 200  # a link followed: reads nothing it could not
        assert c.post("/v1/recommend", json=ask, headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200


def test_the_ui_answers_only_its_own_names_and_pages(open_ui):
    _, url = open_ui
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url, timeout=10) as c:
        for host in FOREIGN:
            r = c.get("/api/options", headers={"Host": host})
            assert r.status_code == 421 and "--allowed-host" in r.json()["error"], (host, r.text)
        assert c.get("/", headers={"Host": "evil.example"}).status_code == 421  # the page too
        for host in (*LOOPBACK, "gpu-box.lan"):
            assert c.get("/api/options", headers={"Host": f"{host}:{port}"}).status_code == 200, host
        assert raw(port, b"GET /api/options HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 400")
        chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
        for origin in ("http://evil.example", "null", f"http://localhost:{port + 1}"):
            r = c.post("/api/endpoints/0/v1/chat/completions", json=chat, headers={"Origin": origin})
            assert r.status_code == 403 and "another origin" in r.json()["error"], (origin, r.text)
        cross = {"Sec-Fetch-Site": "cross-site"}
        assert c.get("/api/endpoints/0/v1/info", headers=cross).status_code == 403  # a forward acts, GET too
        assert c.get("/api/options", headers=cross).status_code == 200
        # the page's own calls: same origin, through to the endpoint
        own = {"Origin": url, "Sec-Fetch-Site": "same-origin"}
        assert c.get("/api/endpoints/0/v1/info", headers=own).json()["workload"] == "recommender"
        r = c.post("/api/endpoints/0/v1/chat/completions", json=chat, headers=own)
        assert r.status_code == 404 and r.json()["detail"] == "Not Found", r.text  # serve's answer: no chat here


def test_the_ui_never_lends_its_endpoints_key(token_ui, keyed):
    url, token = token_ui
    assert token and len(token) >= 32
    direct = keyed[1]

    def info_requests() -> float:
        lines = direct.get("/metrics").text.splitlines()
        line = next((x for x in lines if x.startswith('gpuwise_requests_total{endpoint="/v1/info",status="200"}')),
                    "x 0")
        return float(line.split()[-1])

    before = info_requests()
    with httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/api/endpoints/0/v1/info", "/api/models", "/api/runs", "/api/options"):
            r = c.get(path)
            assert r.status_code == 401 and "?token=" in r.json()["error"] and r.json()["field"] == "key", path
        assert c.post("/api/endpoints/0/v1/chat/completions", json={}).status_code == 401
        assert c.get("/api/endpoints/0/v1/info", headers={"Cookie": "gpuwise_key=k"}).status_code == 401  # not the key
        assert info_requests() == before  # nothing reached the endpoint
        assert c.get("/").status_code == 200  # the page loads, and asks
        assert c.get("/?token=wrong").headers.get("set-cookie") is None
        # the printed URL: its token becomes the key cookie, and leaves the address bar by a redirect
        first = c.get(f"/?page=models&token={token}")
        assert first.status_code == 303 and first.headers["location"] == "/?page=models"
        cookie = first.headers["set-cookie"]
        assert f"gpuwise_key={token}" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        info = c.get("/api/endpoints/0/v1/info")  # the client keeps the cookie, as the browser does
        assert info.status_code == 200 and info.json() == direct.get("/v1/info").json()
        assert info_requests() == before + 2
        assert c.get("/api/models").json()["endpoints"][0]["up"]
        bearer = httpx.get(f"{url}/api/endpoints/0/v1/info", headers={"Authorization": f"Bearer {token}"})
        assert bearer.status_code == 200  # the token typed into the page's key box


def test_the_ui_closes_a_silent_or_slow_connection(open_ui):
    _, url = open_ui
    port = int(url.rsplit(":", 1)[1])
    t0 = time.perf_counter()
    assert raw(port, b"").startswith(b"HTTP/1.1 408 Request Timeout")
    assert time.perf_counter() - t0 < 3  # --read-timeout 1: closed after it, not held open
    head = b"POST /api/endpoints/0/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    t0 = time.perf_counter()
    reply = raw(port, head)  # then nothing: the body never completes
    assert reply.startswith(b"HTTP/1.1 408") and time.perf_counter() - t0 < 3, reply


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def test_a_chunked_body_over_the_uis_cap_is_a_413_without_holding_it(open_ui):
    proc, url = open_ui
    with httpx.Client(base_url=url, timeout=30) as c:
        small = c.post("/api/endpoints/0/v1/predict", content=iter([b"x" * 1000]),
                       headers={"content-type": "application/octet-stream"})
        assert small.status_code == 404  # forwarded (serve has no /v1/predict for this run): the path is warm
        declared = c.post("/api/endpoints/0/v1/predict", content=b"x" * (2 << 20))
        assert declared.status_code == 413  # its Content-Length says so: refused before a byte is read
        peak = _peak_rss(proc.pid)
        body = iter([b"x" * 65536] * 320)  # 20 MB, no Content-Length: chunked, counted as it arrives
        r = c.post("/api/endpoints/0/v1/predict", content=body, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 413 and "over the limit of 1,048,576 bytes" in r.json()["error"], r.text
        # it held at most the 1 MB cap; 20 MB held would show as 20 MB or more (40 MB before, body and copy)
        assert _peak_rss(proc.pid) - peak < 8 << 20, (_peak_rss(proc.pid) - peak) >> 20


def test_non_ascii_digits_in_the_uis_paths_are_a_400(open_ui):
    _, url = open_ui
    with httpx.Client(base_url=url, timeout=30) as c:
        for path, field in [
            ("/api/endpoints/٣/v1/info", None),
            ("/api/endpoints/３/v1/info", None),
            ("/api/runs/٣", None),
            ("/runs/１２/report", None),
            ("/api/plan?model=llama-3.1-8b&batch=٣", "batch"),
            ("/api/plan?model=llama-3.1-8b&gpus=８", "gpus"),
            ("/api/plan?model=llama-3.1-8b&utilization=٠.٥", "utilization"),
            ("/api/runs/" + "9" * 5000, None),  # ASCII, but past what int() takes: one line, not a 500
            ("/api/endpoints/" + "9" * 5000 + "/v1/info", None),
        ]:
            r = c.get(path)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert r.json()["field"] == field and "\n" not in r.json()["error"], (path, r.text)
        assert c.get("/api/endpoints/9/v1/info").status_code == 404  # ASCII, but no such endpoint
        assert c.get("/api/plan?model=llama-3.1-8b&batch=3").status_code == 200
