"""The record: every plan, bench and training run in one SQLite file, and the calibration bench leaves.

SQLite in WAL mode with a busy timeout: two runs that finish at once both land (each write is one
short transaction). Default location: the user's data directory; ``--db`` or GPUWISE_DB override it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sqlite3
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuwise.errors import GpuwiseError
from gpuwise.files import to_json
from gpuwise.results import BenchResult, LaunchRecord, PlanResult, R, Result, TrainSummary, problem

ENV_VAR = "GPUWISE_DB"
KINDS: dict[str, type[Result]] = {
    "plan": PlanResult,
    "bench": BenchResult,
    "train": TrainSummary,
    "launch": LaunchRecord,
}
SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,          -- plan | bench | train | launch
    created TEXT NOT NULL,       -- ISO time, UTC
    device TEXT NOT NULL,        -- cpu:<model>, cuda:<catalog slug>, or the planned accelerator
    name TEXT NOT NULL,          -- the model or workload
    run_dir TEXT,
    data TEXT NOT NULL           -- the command's whole JSON output
);
CREATE TABLE IF NOT EXISTS calibration (
    device TEXT NOT NULL,
    key TEXT NOT NULL,           -- matmul.<dtype> or workload.<name>
    fraction REAL NOT NULL,      -- achieved / dense peak, as gpuwise bench timed it
    record_id INTEGER NOT NULL REFERENCES records(id),
    updated TEXT NOT NULL,
    PRIMARY KEY (device, key)
);
"""


def default_path() -> Path:
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    from platformdirs import user_data_dir

    return Path(user_data_dir("gpuwise")) / "runs.sqlite"


def _refuse_odd(path: Path) -> None:
    """SQLite opens whatever the path names: a FIFO would block it for ever and a directory or device gives
    an error that does not say which file; refuse them by name first."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return  # created on first use
    except OSError as e:  # under a file (/etc/passwd/x), a loop of links, no permission
        raise GpuwiseError(f"cannot open the run record {path}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise GpuwiseError(f"cannot open the run record {path}: it is a directory (an SQLite file is expected)")
    if not stat.S_ISREG(mode):
        raise GpuwiseError(f"cannot open the run record {path}: not a regular file (a device, FIFO or socket)")


def _failed(path: Path, e: sqlite3.Error) -> GpuwiseError:
    """One line for a record SQLite cannot read. A damaged page may show only when a query reaches it, long
    after the open succeeded, so every query goes through `_querying`; a damaged file gets the way back."""
    code = getattr(e, "sqlite_errorname", "") or ""
    if code.startswith("SQLITE_CORRUPT") or "malformed" in str(e):
        quoted = shlex.quote(str(path))
        fixed = shlex.quote(str(path.with_name(f"{path.stem}-recovered{path.suffix or '.sqlite'}")))
        return GpuwiseError(
            f"the run record {path} is damaged ({e}): recover what it still holds with "
            f'`sqlite3 {quoted} ".recover" | sqlite3 {fixed}`, then use that file (--db {fixed}, or move it in '
            "place of the damaged one); see https://sqlite.org/recovery.html"
        )
    if code == "SQLITE_NOTADB" or "not a database" in str(e):
        return GpuwiseError(f"cannot open the run record {path}: {e} (not an SQLite file); pass another --db")
    return GpuwiseError(f"cannot read the run record {path}: {e}")


@contextmanager
def _querying(path: Path | None) -> Iterator[None]:
    try:
        yield
    except sqlite3.DatabaseError as e:  # OperationalError too: locked past the timeout, an I/O error
        raise _failed(Path(path) if path else default_path(), e) from None


def _check_schema(con: sqlite3.Connection, path: Path) -> None:
    """Another program's SQLite file would pass the CREATE IF NOT EXISTS and fail every query later."""
    for table, wanted in (("records", {"id", "kind", "data"}), ("calibration", {"device", "key", "fraction"})):
        have = {row[1] for row in con.execute(f"PRAGMA table_info({table})")}
        if not wanted <= have:
            con.close()
            raise GpuwiseError(f"{path} is not a gpuwise run record (its '{table}' table is another program's)")


def connect(path: Path | None = None) -> sqlite3.Connection:
    path = Path(path) if path else default_path()
    _refuse_odd(path)
    # Two processes creating the file at once race on switching it to WAL, and that switch does not wait
    # on SQLite's busy timeout: retry it for a while (WAL then persists in the file, later opens skip it).
    for attempt in range(60):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            con = sqlite3.connect(path, timeout=30)
            if con.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                con.execute("PRAGMA journal_mode=WAL")
            con.executescript(SCHEMA)
            _check_schema(con, path)
            return con
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise GpuwiseError(f"cannot open the run record {path}: {e}") from None
            time.sleep(min(0.5, 0.02 * (attempt + 1)))
        except sqlite3.DatabaseError as e:
            raise _failed(path, e) from None
        except OSError as e:
            raise GpuwiseError(f"cannot open the run record {path}: {e}") from None
    raise GpuwiseError(f"cannot open the run record {path}: still locked after retries")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record(
    kind: str, device: str, name: str, data: Result | dict, run_dir: str | None = None, path: Path | None = None
) -> int:
    if isinstance(data, Result):
        data = data.dump()
    with _querying(path), closing(connect(path)) as con, con:
        cur = con.execute(
            "INSERT INTO records (kind, created, device, name, run_dir, data) VALUES (?, ?, ?, ?, ?, ?)",
            (kind, now(), device, name, run_dir, to_json(data)),
        )
        assert cur.lastrowid is not None  # set by every INSERT
        return int(cur.lastrowid)


def calibrate(device: str, fractions: Mapping[str, float | None], record_id: int, path: Path | None = None) -> None:
    with _querying(path), closing(connect(path)) as con, con:
        con.executemany(
            "INSERT OR REPLACE INTO calibration (device, key, fraction, record_id, updated) VALUES (?, ?, ?, ?, ?)",
            [(device, key, value, record_id, now()) for key, value in fractions.items() if _usable(value)],
        )


def _usable(value) -> bool:
    """A calibrated fraction or time worth planning with: a noisy fit can come out negative, a failed one nan."""
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


TIMED_PRECISIONS = ("32-true", "bf16-mixed")  # the precisions `gpuwise bench` times a workload's step at


def workload_key(workload: str, precision: str) -> str:
    """Where bench's timing of a workload's step at one precision is kept: workload.<name>@<precision>."""
    return f"workload.{workload}@{precision}"


def calibration(device: str, key: str, path: Path | None = None) -> tuple[float, str] | None:
    """(value, origin) of gpuwise bench's calibration for this device, or None. The value is a fraction of
    peak, except under keys ending in `.s_per_sample`, `.s_per_param` and `.s_per_step` (seconds of a
    workload's step per sample, per trainable parameter and per step)."""
    target = Path(path) if path else default_path()
    if not target.exists():
        return None
    with _querying(target), closing(connect(target)) as con:
        row = con.execute(
            "SELECT fraction, record_id, updated FROM calibration WHERE device = ? AND key = ?", (device, key)
        ).fetchone()
    if row is None or not _usable(row[0]):
        return None
    return row[0], f"measured by gpuwise bench on {device} ({key}, record #{row[1]}, {row[2]})"


def rows(kind: str | None = None, path: Path | None = None) -> list[dict]:
    with _querying(path), closing(connect(path)) as con:
        query = "SELECT id, kind, created, device, name, run_dir, data FROM records"
        args: tuple = ()
        if kind:
            query, args = query + " WHERE kind = ?", (kind,)
        out = con.execute(query + " ORDER BY id", args).fetchall()
    keys = ("id", "kind", "created", "device", "name", "run_dir", "data")
    return [dict(zip(keys, r, strict=True)) | {"data": _data(r[0], r[6], path)} for r in out]


def _data(record_id: int, text, path: Path | None) -> dict:
    try:
        data = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        where = Path(path) if path else default_path()
        raise GpuwiseError(f"record #{record_id} in {where} is damaged: its data is not a JSON object")
    return data


def get(record_id: int, path: Path | None = None) -> dict:
    found = [r for r in rows(path=path) if r["id"] == record_id]
    if not found:
        raise GpuwiseError(f"no record #{record_id} in {Path(path) if path else default_path()}")
    return found[0]


def typed(row: dict[str, Any], path: Path | None = None) -> Result | None:
    """A record's data as the result its kind declares (PlanResult, BenchResult, TrainSummary); None for a
    plan traced on fake tensors or a serving capacity plan (shapes of their own) or a kind this gpuwise does not
    know. Data that does not
    fit its kind (hand-edited, damaged) is one line naming the record."""
    kind = KINDS.get(row["kind"])
    if kind is None or (row["kind"] == "plan" and (row["data"].get("traced") or row["data"].get("task") == "serve")):
        return None
    return load_data(row, kind, path)


def load_data(row: dict[str, Any], kind: type[R], path: Path | None = None) -> R:
    """A record's data as `kind`, or one line naming the record and the field at fault."""
    try:
        return kind.load(row["data"])
    except ValidationError as e:
        where = Path(path) if path else default_path()
        raise GpuwiseError(f"record #{row['id']} in {where} is damaged: {problem(e)}") from None


def compare(path: Path | None = None) -> list[dict[str, Any]]:
    """Every training run's estimates against what it recorded: signed (estimate - actual) / actual."""
    out = []
    for r in rows("train", path):
        summary = load_data(r, TrainSummary, path)
        plan, actual = summary.plan, summary.actual
        row = {"id": r["id"], "workload": r["name"], "device": r["device"], "created": r["created"]}
        for key, label in (("peak_bytes", "memory_error"), ("step_time_s", "step_time_error")):
            p, a = getattr(plan, key), getattr(actual, key)
            row[label] = (p - a) / a if p and a else None
            row[f"plan_{key}"], row[f"actual_{key}"] = p, a
        row["step_time_basis"] = plan.efficiency_origin or plan.time_origin
        out.append(row)
    return out


def calibration_map(path: Path | None = None) -> dict[tuple[str, str], tuple[float, str]]:
    """{(catalog slug, key): (fraction, origin)} for the GPUs bench has run on: what `plan` uses."""
    target = Path(path) if path else default_path()
    if not target.exists():
        return {}
    with _querying(target), closing(connect(target)) as con:
        found = con.execute("SELECT device, key, fraction, record_id, updated FROM calibration").fetchall()
    return {
        (device.split(":", 1)[1], key): (
            fraction,
            f"measured by gpuwise bench on {device} ({key}, record #{rid}, {when})",
        )
        for device, key, fraction, rid, when in found
        if str(device).startswith("cuda:") and _usable(fraction)  # the file may be hand-edited
    }


def try_record(kind: str, device: str, name: str, data: Result | dict, run_dir: str | None = None) -> int | None:
    """Record, or say in one line on stderr why not: a full disk must not cost the user the result."""
    import sys

    try:
        return record(kind, device, name, data, run_dir)
    except (GpuwiseError, sqlite3.Error) as e:
        print(f"gpuwise: warning: not recorded: {e}", file=sys.stderr)
        return None
