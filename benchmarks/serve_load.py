"""`gpuwise serve` under load: dynamic batching on vs batch-1 serving, on a real server on loopback.

Run: .venv/bin/python benchmarks/serve_load.py [--run RUN_DIR] [--requests 256]

Without --run it trains a defects model for a few steps on ELPV (the real image size, 128 px) in a
temp dir: throughput does not depend on how well the model is trained. Each request posts one real
ELPV cell (a 300x300 PNG) to /v1/predict. For each mode a fresh `gpuwise serve` is started; a fixed
number of requests is sent at concurrency 1, 8 and 32 (after a warm-up), and throughput and p50/p99
latency are printed. Issue #5's goal: at concurrency 32, batching gives >= 3x the throughput of
batch-1 serving.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

MODES = {"batch-1": ["--max-batch", "1", "--max-wait-ms", "0"], "batching": ["--max-batch", "32", "--max-wait-ms", "5"]}
CONCURRENCY = (1, 8, 32)


def images(n: int = 16) -> list[bytes]:
    from elpv_dataset.utils import load_dataset
    from PIL import Image

    cells = load_dataset()[0][:n]
    out = []
    for cell in cells:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(cell)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def train(tmp: Path) -> Path:
    run = tmp / "defects"
    cmd = [sys.executable, "-m", "gpuwise", "train", "defects", "--max-steps", "2", "--run-dir", str(run), "--json"]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, GPUWISE_DB=str(tmp / "runs.sqlite")))
    return run


def start(run: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "gpuwise", "serve", str(run), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, port
        except httpx.ConnectError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start: {proc.stderr.read().decode()[-2000:]}")


def request(port: int, png: bytes) -> bytes:
    """One multipart POST, built once: the load generator shares these 2 cores with the server, so it
    must cost as little as it can (a few lines of asyncio streams instead of an HTTP client library)."""
    boundary = b"gpuwiseboundary"
    body = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="cell.png"\r\n'
        b"Content-Type: image/png\r\n\r\n" + png + b"\r\n--" + boundary + b"--\r\n"
    )
    head = (
        f"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary.decode()}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def worker(port: int, payloads: list[bytes], todo: list[int], latencies: list[float]) -> int:
    """One keep-alive connection sending requests one after another; returns its count of non-200s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    errors = 0
    while todo:
        i = todo.pop()
        t = time.perf_counter()
        writer.write(payloads[i % len(payloads)])
        status = (await reader.readline()).split()[1]
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        latencies.append(time.perf_counter() - t)
        errors += status != b"200"
    writer.close()
    return errors


async def drive(port: int, payloads: list[bytes], n: int, concurrency: int) -> tuple[float, np.ndarray, int]:
    warm: list[float] = []
    await asyncio.gather(*(worker(port, payloads, list(range(2)), warm) for _ in range(concurrency)))
    latencies: list[float] = []
    todo = list(range(n))
    t0 = time.perf_counter()
    errors = await asyncio.gather(*(worker(port, payloads, todo, latencies) for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), np.array(latencies), sum(errors)


def model_alone(run: Path) -> dict[int, float]:
    """Seconds per image of the served model's forward alone at batch 1 and 32: what batching can
    gain at most on this device, before any HTTP."""
    import torch

    from gpuwise.train.records import load_config
    from gpuwise.workloads.defects import load_trained

    model, meta = load_trained(run, load_config(run))
    out = {}
    for b in (1, 32):
        x = torch.randn(b, 1, meta["image_size"], meta["image_size"])
        with torch.inference_mode():
            model(x)
            t, n = time.perf_counter(), 0
            while time.perf_counter() - t < 1.0:
                model(x)
                n += 1
        out[b] = (time.perf_counter() - t) / n / b
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a finished defects run (default: train one for 2 steps)")
    ap.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    run = args.run or train(tmp)
    bodies = images()
    alone = model_alone(run)
    print(f"defects model of {run}; {args.requests} requests per level, one {len(bodies[0]) // 1024} kB PNG each")
    print(
        f"model alone: {alone[1] * 1e3:.2f} ms/image at batch 1, {alone[32] * 1e3:.2f} at batch 32: "
        f"batching can gain at most {alone[1] / alone[32]:.2f}x in the model on this device"
    )
    print(f"{'mode':<10}{'concurrency':>12}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}")
    results = {}
    for mode, extra in MODES.items():
        proc, port = start(run, extra)
        payloads = [request(port, b) for b in bodies]
        try:
            for c in CONCURRENCY:
                rps, lat, errors = asyncio.run(drive(port, payloads, args.requests, c))
                results[mode, c] = rps
                p50, p99 = np.percentile(lat, 50) * 1e3, np.percentile(lat, 99) * 1e3
                print(f"{mode:<10}{c:>12}{rps:>10.1f}{p50:>10.1f}{p99:>10.1f}{errors:>8}")
        finally:
            proc.terminate()
            proc.wait(30)
    for c in CONCURRENCY:
        ratio = results["batching", c] / results["batch-1", c]
        print(f"throughput batching / batch-1 at concurrency {c:>2}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
