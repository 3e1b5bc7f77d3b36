"""`gpuwise train --mlflow URI`: the run's metrics in MLflow while it trains (rank 0 only).

Buffered: an HTTP call per step would cost a small model's step more than the step. The buffer goes out
every FLUSH_S seconds and at the end; gpuwise's CLI then completes the run with the summary, plan against
actual and the artifacts (report/mlflow.py), exactly as `gpuwise runs export --mlflow` would. MLflow that is
down costs the run one line, never the run.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from gpuwise.errors import first_line
from gpuwise.files import to_json, write_atomic

ENV_VAR = "GPUWISE_MLFLOW"  # set by `gpuwise train --mlflow URI` for the processes it starts
LIVE_FILE = "mlflow.json"
FLUSH_S = 5.0


def bare(uri: str) -> str:
    """The tracking URI without any user:password in it: what a run directory may keep."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        parts = parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))
    return urlunsplit(parts)


class LiveLog:
    def __init__(self, uri: str, run_dir: Path, name: str):
        self.uri, self.run_dir = uri, run_dir
        self.run_id: str | None = None
        self._buf: list = []
        self._last = time.monotonic()
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name("gpuwise")
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("gpuwise")
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            write_atomic(run_dir / LIVE_FILE, to_json({"tracking_uri": bare(uri), "run_id": self.run_id}) + "\n")
        except Exception as e:  # noqa: BLE001 - MLflow raises its own and requests' errors; none may stop a run
            self._off(e)

    def _off(self, e: BaseException) -> None:
        print(f"gpuwise: warning: MLflow at {bare(self.uri)}: {first_line(e)}; training goes on without it "
              "(`gpuwise runs export --mlflow URI` writes the run there later)", file=sys.stderr)  # fmt: skip
        self.run_id = None

    def log(self, step: int, values: dict) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self._buf += [
            Metric(k, float(v), ms, step)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if time.monotonic() - self._last >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if self.run_id is None or not self._buf:
            return
        try:
            for i in range(0, len(self._buf), 1000):  # MLflow's log_batch takes at most 1000 metrics
                self.client.log_batch(self.run_id, metrics=self._buf[i : i + 1000])
        except Exception as e:  # noqa: BLE001 - as above
            self._off(e)
        self._buf = []
