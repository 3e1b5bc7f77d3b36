"""`gpuwise serve` against careless and hostile clients, on a real server on loopback.

Run: .venv/bin/python benchmarks/serve_abuse.py [--other SRC_DIR] [--streams 20]

It trains a tiny product-lm and defects run in a temp dir (what is measured does not depend on how well
they are trained), starts `gpuwise serve` for each and measures, side by side in one run:
- abandoned work: one 200-token generation alone, then the same request right after `--streams`
  streams were dropped after their first event; the ratio is how many generations the abandoned ones
  still cost (1 when each stops at its next token);
- a 100,000-character stop string: the status, and how much the server's resident memory grew;
- `/health` while one request of four 4096x4096 RGBA PNGs is decoded: its worst latency;
- a client sending one header byte every 2 s: how long it holds its connection (capped at 40 s).
With `--other SRC_DIR` (the `src/` of another gpuwise checkout, e.g. a `git worktree` of an older
commit) each server is also started from that code, and both columns are printed.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def train(tmp: Path) -> dict[str, Path]:
    env = dict(os.environ, GPUWISE_DB=str(tmp / "runs.sqlite"))
    runs = {"product-lm": tmp / "lm", "defects": tmp / "defects"}
    args = {
        "product-lm": [
            "product-lm",
            "--base",
            "scratch",
            "--max-steps",
            "1",
            "--block-size",
            "64",
            "--batch-size",
            "4",
        ],
        "defects": ["defects", "--max-steps", "1", "--image-size", "64", "--batch-size", "8"],
    }
    for name, run in runs.items():
        cmd = [sys.executable, "-m", "gpuwise", "train", *args[name], "--run-dir", str(run), "--json"]
        subprocess.run(cmd, check=True, capture_output=True, env=env)
    return runs


class Served:
    def __init__(self, run: Path, src: str | None, *extra: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=src) if src else dict(os.environ)
        cmd = [sys.executable, "-m", "gpuwise", "serve", str(run), "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.ConnectError:
                time.sleep(0.2)
        raise SystemExit("server did not start")

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def generation(url: str, tokens: int, timeout: float = 600) -> float:
    t0 = time.perf_counter()
    ask = {"prompt": "This coffee", "max_tokens": tokens, "temperature": 0}
    httpx.post(url + "/v1/generate", json=ask, timeout=timeout).raise_for_status()
    return time.perf_counter() - t0


def abandoned(run: Path, src: str | None, streams: int) -> tuple[float, float]:
    with Served(run, src, "--timeout", "3600") as s:
        generation(s.url, 8)  # warm-up
        alone = generation(s.url, 200)
        ask = {"prompt": "This coffee", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=600) as c:
            for _ in range(streams):
                with c.stream("POST", s.url + "/v1/generate", json=ask) as r:
                    next(line for line in r.iter_lines() if line.startswith("data: "))
        return alone, generation(s.url, 200)


def stop_string(run: Path, src: str | None) -> tuple[int, float]:
    with Served(run, src) as s:
        generation(s.url, 8)
        before = s.rss_mb()
        ask = {"prompt": "x", "max_tokens": 4, "stop": ["a" * 100_000]}
        status = httpx.post(s.url + "/v1/generate", json=ask, timeout=600).status_code
        return status, s.rss_mb() - before


def health_during_decode(run: Path, src: str | None) -> float:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGBA", (4096, 4096), (120, 30, 200, 255)).save(buf, "PNG")
    files = [("file", (f"{n}.png", buf.getvalue(), "image/png")) for n in range(4)]
    with Served(run, src) as s:
        worker = threading.Thread(target=lambda: httpx.post(s.url + "/v1/predict", files=files, timeout=600))
        worker.start()
        worst = 0.0
        while worker.is_alive():
            t0 = time.perf_counter()
            httpx.get(s.url + "/health", timeout=600)
            worst = max(worst, time.perf_counter() - t0)
        return worst


def slow_header_hold(run: Path, src: str | None, cap: float = 40.0) -> float:
    with Served(run, src) as s, socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.settimeout(2.0)
        t0 = time.perf_counter()
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
            if time.perf_counter() - t0 > cap:
                break
            try:
                sock.sendall(bytes([byte]))
                sock.recv(1024)  # the server answered or closed: it let go
                break
            except TimeoutError:
                continue
            except OSError:
                break
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", help="src/ of another gpuwise checkout, measured beside this one")
    ap.add_argument("--streams", type=int, default=20)
    args = ap.parse_args()
    columns = {"this checkout": None} | ({"other": args.other} if args.other else {})
    with tempfile.TemporaryDirectory() as tmp:
        runs = train(Path(tmp))
        rows: dict[str, list[str]] = {}
        for src in columns.values():
            alone, after = abandoned(runs["product-lm"], src, args.streams)
            rows.setdefault("200-token generation alone (s)", []).append(f"{alone:.2f}")
            rows.setdefault(f"the same after {args.streams} dropped streams (s)", []).append(f"{after:.2f}")
            rows.setdefault("  = generations it waited for", []).append(f"{after / alone:.1f}")
            status, grew = stop_string(runs["product-lm"], src)
            rows.setdefault("100,000-char stop string: status", []).append(str(status))
            rows.setdefault("  server memory grew (MB)", []).append(f"{grew:.0f}")
            rows.setdefault("/health worst during 4 x 4096² decode (s)", []).append(
                f"{health_during_decode(runs['defects'], src):.2f}"
            )
            rows.setdefault("1 header byte / 2 s: connection held (s)", []).append(
                f"{slow_header_hold(runs['defects'], src):.1f}"
            )
    print(f"{'scenario':45}" + "".join(f"{c:>16}" for c in columns))
    for name, values in rows.items():
        print(f"{name:45}" + "".join(f"{v:>16}" for v in values))


if __name__ == "__main__":
    main()
