"""Real servers behind the record's tests: a PostgreSQL of the session's own (tests/engines/postgres_local.sh,
Debian's postgresql, on loopback) and an `mlflow server` (PyPI). One of each, started once; each test gets
its own database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Until `url` answers 200, or the server has died (its log's tail in the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer:\n" + log.read_text()[-3000:])
        time.sleep(0.5)


class Postgres:
    """The server; `database()` makes a new empty database on it and returns its URL (no password in it:
    libpq reads it from PGPASSFILE, which the fixture sets)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpuwise-pg-", dir="/tmp"))  # the postgres user must reach it
        self.port = free_port()
        done = subprocess.run(["bash", str(ROOT / "tests/engines/postgres_local.sh"), "up", str(self.dir),
                               str(self.port)], capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        self.url = done.stdout.strip().splitlines()[-1]
        self.passfile = str(self.dir / "pgpass")
        self.password = (self.dir / "pgpass").read_text().strip().rsplit(":", 1)[1]

    def database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=gpuwise dbname=gpuwise passfile={self.passfile}",
                             autocommit=True) as con:  # fmt: skip
            con.execute(f"CREATE DATABASE {name}")
        return f"postgresql://gpuwise@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run(["bash", str(ROOT / "tests/engines/postgres_local.sh"), "down", str(self.dir)],
                       capture_output=True, timeout=120)  # fmt: skip
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


class MlflowServer:
    """`mlflow server` on loopback: its own SQLite store and artifact folder, artifacts served through it."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "mlflow.log", "wb")  # noqa: SIM115 - held for the server's life
        mlflow = Path(sys.executable).with_name("mlflow")
        self.proc = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
             str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
            env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        )  # fmt: skip
        try:
            wait_ready(f"{self.uri}/health", self.proc, root / "mlflow.log")
        except AssertionError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        self.log.close()
