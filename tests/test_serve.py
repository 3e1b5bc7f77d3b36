"""`gpuwise serve` on a real uvicorn on loopback: every endpoint, every class of bad input, a bounded
load at concurrency 32, the API key, and a graceful SIGTERM."""

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from gpuwise.cli import main

from train_data import image_folder, interactions_csv, reviews_jsonl


def trained(tmp: Path, workload: str) -> Path:
    run = tmp / workload
    data = {
        "defects": f"defects --data {image_folder(tmp / 'cells')} --image-size 32 --batch-size 8 --max-steps 2",
        "recommender": f"recommender --data {interactions_csv(tmp / 'i.csv')} --batch-size 64 --max-steps 3",
        "product-lm": f"product-lm --data {reviews_jsonl(tmp / 'r.jsonl')} --block-size 32 --batch-size 4"
        " --max-steps 1",
    }[workload]
    assert main(f"train {data} --run-dir {run}".split()) == 0
    return run


class Server:
    """uvicorn in a thread, on a free loopback port, serving one run."""

    def __init__(self, run: Path, **settings):
        import uvicorn

        from gpuwise.serve.app import Settings, create_app
        from gpuwise.serve.models import Limits, load_served

        limits = Limits(**settings.pop("limits", {}))
        served, _ = load_served(run, settings.get("runtime", "torch"), limits)
        app = create_app(served, Settings(str(run), limits=limits, **settings), run_id=run.name, precision="fp32")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with pytest.MonkeyPatch.context() as mp:  # a module fixture runs before conftest's private record
        mp.setenv("GPUWISE_DB", str(tmp / "runs.sqlite"))
        return {w: trained(tmp, w) for w in ("defects", "recommender", "product-lm")}


def png(size=(40, 40), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


def test_defects_endpoints_and_bad_images(runs):
    with Server(runs["defects"], limits={"max_pixels": 100 * 100, "max_body_bytes": 200_000}) as c:
        assert c.get("/health").json()["status"] == "ok"
        info = c.get("/v1/info").json()
        assert info["workload"] == "defects" and info["device"] == "cpu" and info["run_id"] == "defects"
        files = [("file", ("a.png", png(), "image/png")), ("file", ("b.jpg", png(fmt="JPEG"), "image/jpeg"))]
        r = c.post("/v1/predict", files=files)
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        assert [p["file"] for p in preds] == ["a.png", "b.jpg"]
        assert all(0 <= p["probability"] <= 1 and p["label"] in ("functional", "defective") for p in preds)

        def status(files=None, **kw):
            r = c.post("/v1/predict", files=files, **kw)
            assert "detail" in r.json()
            return r.status_code, r.json()["detail"]

        assert status([("file", ("x.png", b"\x89PNG\r\n\x1a\n broken", "image/png"))])[0] == 422  # corrupt
        assert status([("file", ("big.png", png((200, 200)), "image/png"))]) == (
            413, "big.png: 200x200 pixels is over the limit of 10,000")
        assert status([("file", ("x.gif", png(fmt="GIF"), "image/gif"))])[0] == 415
        assert status()[0] == 422  # no file field
        assert status(content=b"x" * 300_000, headers={"content-type": "multipart/form-data; boundary=b"})[0] == 413
        assert c.get("/v1/recommend").status_code == 404  # not this run's endpoint
        assert "/v1/predict" in c.get("/openapi.json").json()["paths"] and c.get("/docs").status_code == 200
        metrics = c.get("/metrics").text
        assert 'gpuwise_requests_total{endpoint="/v1/predict",status="200"} 1.0' in metrics
        assert 'gpuwise_requests_total{endpoint="/v1/predict",status="413"}' in metrics
        assert "gpuwise_batch_size_bucket" in metrics and "gpuwise_queue_depth" in metrics


async def _load(url: str, n: int, concurrency: int, body: bytes) -> list[int]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def one():
            async with sem:
                r = await c.post("/v1/predict", files=[("file", ("c.png", body, "image/png"))])
                return r.status_code

        return await asyncio.gather(*(one() for _ in range(n)))


def test_bounded_load_at_concurrency_32_has_no_errors_and_is_batched(runs):
    with Server(runs["defects"], max_batch=32, max_wait_ms=5) as c:
        codes = asyncio.run(_load(str(c.base_url), 300, 32, png()))
        assert codes == [200] * 300
        sizes = [line for line in c.get("/metrics").text.splitlines() if line.startswith("gpuwise_batch_size_")]
        count = float(next(s for s in sizes if s.startswith("gpuwise_batch_size_count")).split()[-1])
        assert count < 300, "300 images in as many passes: nothing was batched"


def test_recommender_known_unknown_and_limits(runs):
    with Server(runs["recommender"], limits={"max_k": 20}) as c:
        r = c.post("/v1/recommend", json={"user": "u1", "k": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["source"] == "model" and len(body["items"]) == 5
        scores = [it["score"] for it in body["items"]]
        assert scores == sorted(scores, reverse=True)
        seen = c.post("/v1/recommend", json={"user": "u1", "k": 20, "exclude_seen": False}).json()["items"]
        assert len(seen) == 20 and seen[0]["score"] >= scores[0]  # seen items compete too: the best is no worse
        cold = c.post("/v1/recommend", json={"user": "nobody", "k": 3}).json()
        assert cold["source"] == "popular" and len(cold["items"]) == 3 and cold["items"][0]["score"] is None
        assert c.post("/v1/recommend", json={"user": "u1", "k": 21}).json()["detail"] == "k: must be between 1 and 20"
        assert c.post("/v1/recommend", json={"k": 3}).status_code == 422
        broken = c.post("/v1/recommend", content=b"{not json", headers={"content-type": "application/json"})
        assert broken.status_code == 422


def test_generate_plain_streamed_stop_and_limits(runs):
    with Server(runs["product-lm"], limits={"max_tokens": 16}) as c:
        r = c.post("/v1/generate", json={"prompt": "This coffee", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["tokens"] <= 8 and out["finish_reason"] in ("length", "stop")
        again = c.post("/v1/generate", json={"prompt": "This coffee", "max_tokens": 8, "temperature": 0}).json()
        assert again["text"] == out["text"]  # greedy is deterministic
        with c.stream("POST", "/v1/generate", json={"prompt": "This coffee", "max_tokens": 8, "temperature": 0,
                                                    "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["text"] for e in events[:-1]) == out["text"]
        if len(out["text"]) > 2:
            stop = out["text"][1:3]
            cut = c.post("/v1/generate", json={"prompt": "This coffee", "max_tokens": 8, "temperature": 0,
                                               "stop": [stop]}).json()
            assert cut["text"] == out["text"][: out["text"].index(stop)] and cut["finish_reason"] == "stop"
        too_long = c.post("/v1/generate", json={"prompt": "x", "max_tokens": 17}).json()
        assert too_long["detail"] == "max_tokens: at most 16"
        assert c.post("/v1/generate", json={"prompt": ""}).status_code == 422
        assert c.post("/v1/generate", json={"prompt": "x", "top_p": 0}).status_code == 422
        assert c.post("/v1/generate", json={"prompt": "x", "stop": [""]}).status_code == 422


def test_api_key_is_required_on_every_request(runs):
    with Server(runs["recommender"], api_key="s3cret") as c:
        assert c.get("/health").status_code == 401
        assert c.post("/v1/recommend", json={"user": "u1"}, headers={"X-API-Key": "wrong"}).status_code == 401
        assert c.get("/health", headers={"X-API-Key": "s3cret"}).status_code == 200
        assert c.get("/v1/info", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("workload", ["defects", "recommender"])
def test_onnx_runtime_serves_what_torch_serves(runs, workload, tmp_path):
    import shutil

    run = shutil.copytree(runs[workload], tmp_path / workload)
    assert main(["export", str(run), "--format", "onnx"]) == 0
    if workload == "defects":
        ask = lambda c: c.post("/v1/predict", files=[("file", ("a.png", png(), "image/png"))])  # noqa: E731
        value = lambda r: r.json()["predictions"][0]["probability"]  # noqa: E731
    else:
        ask = lambda c: c.post("/v1/recommend", json={"user": "u3", "k": 5})  # noqa: E731
        value = lambda r: [it["score"] for it in r.json()["items"]]  # noqa: E731
    with Server(run) as c:
        by_torch = value(ask(c))
    with Server(run, runtime="onnx") as c:
        assert c.get("/v1/info").json()["device"] == "cpu (onnxruntime)"
        assert value(ask(c)) == pytest.approx(by_torch, abs=1e-4)


def test_request_timeout_is_a_504_not_a_crash(runs):
    with Server(runs["defects"], limits={"timeout_s": 0.000001}) as c:
        r = c.post("/v1/predict", files=[("file", ("a.png", png(), "image/png"))])
        assert r.status_code == 504 and "timeout" in r.json()["detail"]
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("argv, needle", [
    (["serve", "RUN", "--host", "0.0.0.0"], "set --api-key or GPUWISE_API_KEY"),
    (["serve", "RUN", "--runtime", "tensorrt"], "choose torch or onnx"),
    (["serve", "/nonexistent/run"], "no such run directory"),
])
def test_serve_refusals_are_one_line(capsys, monkeypatch, runs, argv, needle):
    monkeypatch.delenv("GPUWISE_API_KEY", raising=False)
    assert main([str(runs["defects"]) if a == "RUN" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_sigterm_lets_the_request_in_flight_finish(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gpuwise", "serve", str(runs["product-lm"]), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "no start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                time.sleep(0.1)
        result = {}
        ask = {"prompt": "This coffee", "max_tokens": 200, "temperature": 0}
        post = lambda: result.update(r=httpx.post(url + "/v1/generate", json=ask, timeout=60))  # noqa: E731
        worker = threading.Thread(target=post)
        worker.start()
        time.sleep(0.5)  # the request is in flight
        proc.send_signal(signal.SIGTERM)
        worker.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["tokens"] > 0
        assert proc.wait(30) == -signal.SIGTERM  # uvicorn re-raises the signal once drained: the usual exit
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
