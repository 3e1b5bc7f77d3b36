"""What the Runs and Bench pages read: the run record (`gpuwise runs`), and the run directories under the
runs folder, so that a run still training (not yet recorded) shows, and its curves grow as it logs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.files import MAX_METRICS_BYTES, read_run_file, run_file_lines
from gpuwise.report.html import parse_object
from gpuwise.runs import db
from gpuwise.train.records import METRICS, SUMMARY, is_finished, is_running, load_config

# A run page shows at most this many points per curve: a million-step log thinned, not shipped whole.
MAX_POINTS = 2000


def _status(run_dir: Path) -> str:
    if is_finished(run_dir):
        return "finished"
    return "running" if is_running(run_dir) else "stopped"


def _headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The two or three numbers of a run a table row shows: its held-out metrics' first keys."""
    metrics = summary.get("eval") or {}
    return {k: v for k, v in list(metrics.items())[:4] if isinstance(v, int | float) and not isinstance(v, bool)}


def run_rows(runs_dir: Path) -> list[dict[str, Any]]:
    """Every recorded training run, newest first, then every run directory under `runs_dir` the record does
    not hold (a run training now, or one stopped before it finished)."""
    rows, seen = [], set()
    for r in reversed(db.rows("train")) if db.where().exists() else []:
        data = r["data"]
        run_dir = Path(r["run_dir"] or data.get("run_dir") or "")
        seen.add(os.path.realpath(run_dir))
        rows.append({
            "key": str(r["id"]),
            "workload": data.get("workload") or r["name"],
            "status": "finished",
            "created": r["created"],
            "device": data.get("device") or r["device"],
            "run_dir": str(run_dir),
            "metrics": _headline(data),
            "wall_s": data.get("wall_s"),
        })  # fmt: skip
    for run_dir in sorted(_run_dirs(runs_dir), key=_mtime, reverse=True):
        if os.path.realpath(run_dir) in seen:
            continue
        status = _status(run_dir)
        try:
            summary = _summary(run_dir) if status == "finished" else {}
        except GpuwiseError:  # one damaged or planted run must not hide the others: its own page says why
            summary = {}
        rows.append({
            "key": run_dir.name,
            "workload": summary.get("workload") or run_dir.name.split("-")[0],
            "status": status,
            "created": None,
            "device": summary.get("device"),
            "run_dir": str(run_dir),
            "metrics": _headline(summary),
            "wall_s": summary.get("wall_s"),
        })  # fmt: skip
    return rows


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since it was listed
        return 0.0


def _run_dirs(runs_dir: Path) -> list[Path]:
    try:
        return [p for p in runs_dir.iterdir() if p.is_dir() and (p / "config.yaml").is_file()]
    except OSError:  # no runs folder yet
        return []


def run_path(key: str, runs_dir: Path) -> Path:
    """The run directory a page key names: a record id, or a directory's name under `runs_dir`."""
    if key.isascii() and key.isdigit():  # '²'.isdigit() holds too, and int() refuses it: a 500 it was

        row = db.get(int(key))
        if row["kind"] != "train":
            raise GpuwiseError(f"record #{key} is a {row['kind']}, not a training run")
        return Path(row["run_dir"] or row["data"].get("run_dir") or "")
    if "/" in key or "\\" in key or key in ("", ".", ".."):
        raise GpuwiseError(f"no run '{key[:80]}' under {runs_dir}")
    path = runs_dir / key
    if not (path / "config.yaml").is_file():
        raise GpuwiseError(f"no run '{key[:80]}' under {runs_dir}")
    return path


def _curves(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Each logged number as [step, value] pairs, thinned to MAX_POINTS (every k-th row, the last kept)."""
    k = max(1, -(-len(rows) // MAX_POINTS))
    kept = rows[::k] + ([rows[-1]] if rows and (len(rows) - 1) % k else [])
    curves: dict[str, list[list[float]]] = {}
    for row in kept:
        step = row.get("step")
        if not isinstance(step, int | float):
            continue
        for name, value in row.items():
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                curves.setdefault(name, []).append([step, value])
    return curves


def _summary(run_dir: Path) -> dict[str, Any]:
    text = read_run_file(run_dir / SUMMARY, "run file", "the summary.json gpuwise train writes")
    return parse_object(str(run_dir / SUMMARY), text)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as far as it is written (none yet: no rows), for a run that may still be training: read
    a block at a time, never through a link, and never a FIFO or device (files.run_file_lines)."""
    path = run_dir / METRICS
    if not os.path.lexists(path):
        return []
    rows = []
    lines = run_file_lines(path, "run file", "the metrics.jsonl gpuwise train writes", MAX_METRICS_BYTES)
    for n, line in enumerate(lines, 1):
        if not line.endswith("\n"):  # the last line of a run still writing it may be cut
            break
        if line.strip():
            rows.append(parse_object(f"{path}:{n}", line))
    return rows


def run_detail(key: str, runs_dir: Path) -> dict[str, Any]:
    """A run's page: status, config, curves from metrics.jsonl (as far as it is written), and for a finished
    run its summary (held-out metrics, baselines, planned beside actual). The config is shown, not acted on:
    its workload is not looked up, so a package.module:Class it names is not imported."""
    path = run_path(key, runs_dir)
    status = _status(path)
    return {
        "key": key,
        "run_dir": str(path),
        "status": status,
        "config": load_config(path, resolve=False).as_dict(),
        "curves": _curves(_metrics(path)),
        "summary": _summary(path) if status == "finished" else None,
    }


def bench_rows() -> list[dict[str, Any]]:
    """Every `gpuwise bench` record, newest first: per device and dtype, as a fraction of peak."""
    if not db.where().exists():
        return []
    return [
        {"key": str(r["id"]), "created": r["created"], "device": r["device"], "data": r["data"]}
        for r in reversed(db.rows("bench"))
    ]
