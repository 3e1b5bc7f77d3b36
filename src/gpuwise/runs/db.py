"""The record: every plan, bench, run, endpoint and launched job, and the calibration bench leaves.

One schema (runs/schema.py), two back-ends through SQLAlchemy Core: an SQLite file, the default with no
set-up (the user's data directory), or a team's PostgreSQL (``GPUWISE_DB=postgresql://...`` or ``--db``).
Both run the same Alembic migrations (runs/migrations/), the first time a process opens a record that is
behind. Ids are the database's; every write is one short transaction, so many processes on many nodes write
at once and nothing is lost. A record that cannot be reached never costs a run its result: `try_record`
keeps it in a pending file, and `gpuwise runs sync` writes it later.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import shlex
import sqlite3
import stat
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, create_engine, event, inspect, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from gpuwise.errors import GpuwiseError
from gpuwise.files import to_json
from gpuwise.results import BenchResult, LaunchRecord, PlanResult, R, Result, TrainSummary, problem
from gpuwise.runs.schema import HEAD, records
from gpuwise.runs.schema import calibration as calibration_t

ENV_VAR = "GPUWISE_DB"
KINDS: dict[str, type[Result]] = {
    "plan": PlanResult,
    "bench": BenchResult,
    "train": TrainSummary,
    "launch": LaunchRecord,
}
RECORDED_KINDS = (*KINDS, "serve", "bench-serve")  # what a pending file may hold
PENDING = ".gpuwise-pending"  # a run directory's records that could not be written yet
MIGRATIONS = Path(__file__).with_name("migrations")
MIGRATION_LOCK = 0x67707769  # PostgreSQL advisory lock: one process migrates a shared record at a time


class Unreachable(GpuwiseError):
    """The record's server did not answer (down, refused, wrong password): a run goes on without it."""


@dataclass(frozen=True)
class Where:
    """Where the record is: an SQLite file (`path`) or a server (`path` None). `shown` is what messages print:
    the path, or the URL with its password masked; the URL itself never leaves this module."""

    url: URL
    path: Path | None
    shown: str

    def __str__(self) -> str:
        return self.shown

    def exists(self) -> bool:
        """False only for an SQLite file not made yet: reading it then would create it for nothing."""
        return self.path is None or self.path.exists()


def default_file() -> Path:
    from platformdirs import user_data_dir  # here, not at the top: only without --db or GPUWISE_DB

    return Path(user_data_dir("gpuwise")) / "runs.sqlite"


def where(target: str | Path | None = None) -> Where:
    """The record named by `target`, else GPUWISE_DB (what --db sets), else the user's SQLite file."""
    raw = str(target) if target else os.environ.get(ENV_VAR) or str(default_file())
    if "://" not in raw:
        path = Path(raw).expanduser()
        return Where(URL.create("sqlite", database=str(path)), path, str(path))
    try:
        url = make_url(raw)
        backend = url.get_backend_name()
    except (ArgumentError, ValueError):
        raise GpuwiseError(
            "the run record's address is not a database URL: give a file, or postgresql://USER@HOST/DB"
        ) from None
    if backend == "sqlite":
        path = Path(url.database or "").expanduser()
        if not url.database:
            raise GpuwiseError("the run record sqlite:// names no file: give sqlite:///PATH or a path")
        return Where(URL.create("sqlite", database=str(path)), path, str(path))
    if backend != "postgresql":
        raise GpuwiseError(f"the run record cannot be kept in {backend}: give a file (SQLite) or postgresql://...")
    # psycopg 3, which hands the URL to libpq: with no password in it, ~/.pgpass, PGPASSFILE or a
    # service file (?service=NAME) give it, as for psql.
    url = url.set(drivername="postgresql+psycopg")
    shown = url.set(drivername="postgresql").render_as_string(hide_password=True)
    return Where(url, None, shown)


_engines: dict[str, Engine] = {}
_migrated: set[str] = set()  # the records this process has seen at HEAD: one query, then none


def _engine(w: Where) -> Engine:
    key = w.url.render_as_string(hide_password=False)
    if key in _engines:
        return _engines[key]
    # NullPool: a gpuwise command makes a handful of queries and may fork (a training run's workers, a
    # server's engine): a pooled connection shared across a fork is a corrupted one.
    if w.path is not None:
        engine = create_engine(w.url, poolclass=NullPool, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_connected)
        event.listen(engine, "begin", _sqlite_begin)
    else:
        engine = create_engine(
            w.url, poolclass=NullPool, connect_args={"connect_timeout": 10, "application_name": "gpuwise"}
        )
    _engines[key] = engine
    return engine


def _sqlite_connected(dbapi_con: sqlite3.Connection, _record: Any) -> None:
    # gpuwise emits BEGIN itself (_sqlite_begin): Python's sqlite3 would otherwise commit DDL on its own and
    # let two processes migrate one new file at once (SQLAlchemy's documented recipe for pysqlite).
    dbapi_con.isolation_level = None
    # Two processes creating the file at once race on switching it to WAL, and that switch does not wait on
    # SQLite's busy timeout: retry it for a while (WAL then persists in the file, later opens skip it).
    for attempt in range(60):
        try:
            if dbapi_con.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                dbapi_con.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            time.sleep(min(0.5, 0.02 * (attempt + 1)))
    raise sqlite3.OperationalError("database is locked (switching to WAL)")


def _sqlite_begin(con: Connection) -> None:
    # IMMEDIATE for a write: it waits on the busy timeout for the lock, where a deferred transaction that
    # read first would fail at once on its first write when another process wrote in between.
    con.exec_driver_sql("BEGIN IMMEDIATE" if con.get_execution_options().get("write") else "BEGIN")


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


def _failed(w: Where, e: Exception) -> GpuwiseError:
    """One line for a record that cannot be read or reached. A damaged SQLite page may show only when a
    query reaches it, long after the open succeeded: every query runs inside `connect`."""
    orig = getattr(e, "orig", None) or e
    if w.path is None:
        first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        if isinstance(e, OperationalError):  # what the driver raises for a server it cannot reach or log in to
            return Unreachable(f"cannot reach the run record {w}: {first}")
        return GpuwiseError(f"the run record {w} refused a query: {first}")
    code = getattr(orig, "sqlite_errorname", "") or ""
    if code.startswith("SQLITE_CORRUPT") or "malformed" in str(orig):
        quoted = shlex.quote(str(w.path))
        fixed = shlex.quote(str(w.path.with_name(f"{w.path.stem}-recovered{w.path.suffix or '.sqlite'}")))
        return GpuwiseError(
            f"the run record {w} is damaged ({orig}): recover what it still holds with "
            f'`sqlite3 {quoted} ".recover" | sqlite3 {fixed}`, then use that file (--db {fixed}, or move it in '
            "place of the damaged one); see https://sqlite.org/recovery.html"
        )
    if code == "SQLITE_NOTADB" or "not a database" in str(orig):
        return GpuwiseError(f"cannot open the run record {w}: {orig} (not an SQLite file); pass another --db")
    if code == "SQLITE_CANTOPEN" or "unable to open" in str(orig):
        return GpuwiseError(f"cannot open the run record {w}: {orig}")
    return GpuwiseError(f"cannot read the run record {w}: {orig}")


@contextmanager
def connect(target: str | Path | None = None, write: bool = False) -> Iterator[Connection]:
    """One transaction on the record, migrated to HEAD first if it is behind; committed on leaving."""
    w = where(target)
    if w.path is not None:
        _refuse_odd(w.path)
        try:
            w.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GpuwiseError(f"cannot open the run record {w}: {e.strerror or e}") from None
    try:
        with _engine(w).connect() as con:
            if str(w.url) not in _migrated:
                _migrate(con, w)
            with con.execution_options(write=write).begin():
                yield con
    except SQLAlchemyError as e:
        raise _failed(w, e) from None
    except OSError as e:  # the SQLite file's directory vanished, a full disk
        raise GpuwiseError(f"cannot write the run record {w}: {e.strerror or e}") from None


def _revision(con: Connection) -> str | None:
    if not inspect(con).has_table("alembic_version"):
        return None
    return con.execute(text("SELECT version_num FROM alembic_version")).scalar()


def _migrate(con: Connection, w: Where) -> None:
    """Bring the record to HEAD: Alembic's migrations, one process at a time (SQLite's write lock, or a
    PostgreSQL advisory lock), each checking again under the lock whether another did it first."""
    with con.execution_options(write=True).begin():
        if con.dialect.name == "postgresql":
            con.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        found = _revision(con)
        if found != HEAD:
            _check_tables(con, w)
            from alembic import command, config  # here, not at the top: only a record that is behind needs them

            cfg = config.Config()
            cfg.set_main_option("script_location", str(MIGRATIONS))
            cfg.attributes["connection"] = con
            try:
                command.upgrade(cfg, "head")
            except Exception as e:  # noqa: BLE001 - Alembic's own errors (a revision this gpuwise lacks)
                if isinstance(e, SQLAlchemyError):
                    raise
                raise GpuwiseError(
                    f"the run record {w} is at revision {found}, which this gpuwise does not know "
                    f"(it knows up to {HEAD}): a newer gpuwise wrote it; upgrade gpuwise"
                ) from None
    _migrated.add(str(w.url))


def _check_tables(con: Connection, w: Where) -> None:
    """Another program's file or database would pass the migration and fail every query later."""
    insp = inspect(con)
    for table, wanted in (("records", {"id", "kind", "data"}), ("calibration", {"device", "key", "fraction"})):
        if insp.has_table(table):
            have = {c["name"] for c in insp.get_columns(table)}
            if not wanted <= have:
                raise GpuwiseError(f"{w} is not a gpuwise run record (its '{table}' table is another program's)")


def migrate(target: str | Path | None = None) -> str:
    """Bring a record to HEAD now (gpuwise does it on first use anyway); returns the revision it is at."""
    with connect(target) as con:
        return str(_revision(con))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


TEAM_VAR = "GPUWISE_TEAM"  # the team a member's records count for in `gpuwise fleet --by team`


def whoami() -> dict[str, str | None]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container's uid with no passwd entry
        user = str(os.getuid())
    return {"user": user, "team": os.environ.get(TEAM_VAR) or None}


def record(
    kind: str,
    device: str,
    name: str,
    data: Result | dict,
    run_dir: str | None = None,
    path: str | Path | None = None,
    created: str | None = None,
    who: dict[str, str | None] | None = None,
) -> int:
    """Insert one record; its id is the database's. `who`: the user and team (a pending record's own)."""
    if isinstance(data, Result):
        data = data.dump()
    who = who or whoami()
    row = {"kind": kind, "created": created or now(), "device": device, "name": name, "run_dir": run_dir,
           "user": who["user"], "team": who["team"]}  # fmt: skip
    with connect(path, write=True) as con:
        new_id = con.execute(records.insert().values(**row, data=to_json(data))).inserted_primary_key
        assert new_id is not None  # set by every INSERT of a row with an autoincrement key
        return int(new_id[0])


def calibrate(
    device: str, fractions: Mapping[str, float | None], record_id: int, path: str | Path | None = None
) -> None:
    """Keep bench's fractions for this device, one row per key: a newer bench replaces its own keys only."""
    rows_ = [
        {"device": device, "key": k, "fraction": v, "record_id": record_id, "updated": now()}
        for k, v in fractions.items()
        if _usable(v)
    ]
    if not rows_:
        return
    with connect(path, write=True) as con:
        stmt = (postgresql if con.dialect.name == "postgresql" else sqlite).insert(calibration_t)
        con.execute(
            stmt.on_conflict_do_update(
                index_elements=["device", "key"],
                set_={c: stmt.excluded[c] for c in ("fraction", "record_id", "updated")},
            ),
            rows_,
        )


def _usable(value) -> bool:
    """A calibrated fraction or time worth planning with: a noisy fit can come out negative, a failed one nan."""
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


TIMED_PRECISIONS = ("32-true", "bf16-mixed")  # the precisions `gpuwise bench` times a workload's step at


def workload_key(workload: str, precision: str) -> str:
    """Where bench's timing of a workload's step at one precision is kept: workload.<name>@<precision>."""
    return f"workload.{workload}@{precision}"


def _origin(device: str, key: str, record_id: int, updated: str) -> str:
    return f"measured by gpuwise bench on {device} ({key}, record #{record_id}, {updated})"


def calibration(device: str, key: str, path: str | Path | None = None) -> tuple[float, str] | None:
    """(value, origin) of gpuwise bench's calibration for this device, or None. The value is a fraction of
    peak, except under keys ending in `.s_per_sample`, `.s_per_param` and `.s_per_step` (seconds of a
    workload's step per sample, per trainable parameter and per step)."""
    if not where(path).exists():
        return None
    c = calibration_t.c
    try:
        with connect(path) as con:
            row = con.execute(
                select(c.fraction, c.record_id, c.updated).where(c.device == device, c.key == key)
            ).first()
    except Unreachable as e:
        _uncalibrated(e)
        return None
    if row is None or not _usable(row[0]):
        return None
    return row[0], _origin(device, key, row[1], row[2])


def calibration_map(path: str | Path | None = None) -> dict[tuple[str, str], tuple[float, str]]:
    """{(catalog slug, key): (fraction, origin)} for the GPUs bench has run on: what `plan` uses. A record
    that cannot be reached plans uncalibrated, and says so in one line."""
    if not where(path).exists():
        return {}
    c = calibration_t.c
    try:
        with connect(path) as con:
            found = con.execute(select(c.device, c.key, c.fraction, c.record_id, c.updated)).all()
    except Unreachable as e:
        _uncalibrated(e)
        return {}
    return {
        (device.split(":", 1)[1], key): (fraction, _origin(device, key, rid, when))
        for device, key, fraction, rid, when in found
        if str(device).startswith("cuda:") and _usable(fraction)  # the record may be hand-edited
    }


_said: set[str] = set()


def _uncalibrated(e: Unreachable) -> None:
    """A record that cannot be reached costs a plan its calibration: said once per process, not per key."""
    if str(e) not in _said:
        _said.add(str(e))
        print(f"gpuwise: warning: {e}; planning with no measured calibration", file=sys.stderr)


_COLUMNS = ("id", "kind", "created", "device", "name", "run_dir", "user", "team", "data")


def rows(kind: str | None = None, path: str | Path | None = None) -> list[dict]:
    query = select(*(records.c[k] for k in _COLUMNS)).order_by(records.c.id)
    if kind:
        query = query.where(records.c.kind == kind)
    with connect(path) as con:
        out = con.execute(query).all()
    return [dict(zip(_COLUMNS, r, strict=True)) | {"data": _data(r[0], r[-1], path)} for r in out]


def _data(record_id: int, raw, path: str | Path | None) -> dict:
    try:
        data = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise GpuwiseError(f"record #{record_id} in {where(path)} is damaged: its data is not a JSON object")
    return data


def get(record_id: int, path: str | Path | None = None) -> dict:
    with connect(path) as con:
        r = con.execute(select(*(records.c[k] for k in _COLUMNS)).where(records.c.id == record_id)).first()
    if r is None:
        raise GpuwiseError(f"no record #{record_id} in {where(path)}")
    return dict(zip(_COLUMNS, r, strict=True)) | {"data": _data(r[0], r[-1], path)}


def typed(row: dict[str, Any], path: str | Path | None = None) -> Result | None:
    """A record's data as the result its kind declares (PlanResult, BenchResult, TrainSummary); None for a
    plan traced on fake tensors or a serving capacity plan (shapes of their own) or a kind this gpuwise does
    not know. Data that does not fit its kind (hand-edited, damaged) is one line naming the record."""
    kind = KINDS.get(row["kind"])
    if kind is None or (row["kind"] == "plan" and (row["data"].get("traced") or row["data"].get("task") == "serve")):
        return None
    return load_data(row, kind, path)


def load_data(row: dict[str, Any], kind: type[R], path: str | Path | None = None) -> R:
    """A record's data as `kind`, or one line naming the record and the field at fault."""
    try:
        return kind.load(row["data"])
    except ValidationError as e:
        raise GpuwiseError(f"record #{row['id']} in {where(path)} is damaged: {problem(e)}") from None


def compare(path: str | Path | None = None) -> list[dict[str, Any]]:
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


# --- a record that is down: pending files, and `gpuwise runs sync` ---


def pending_dir(run_dir: str | None) -> Path:
    """Where a record that could not be written waits: its run directory's, else the user's spool."""
    if run_dir:
        return Path(run_dir) / PENDING
    return default_file().with_name("pending")


def try_record(kind: str, device: str, name: str, data: Result | dict, run_dir: str | None = None) -> int | None:
    """Record, or say in one line on stderr why not and keep the record in a pending file: a record that is
    down, or a full disk, must not cost the user the result."""
    if isinstance(data, Result):
        data = data.dump()
    created = now()
    try:
        return record(kind, device, name, data, run_dir, created=created)
    except GpuwiseError as e:
        entry = {"kind": kind, "device": device, "name": name, "run_dir": run_dir, "created": created, "data": data,
                 **whoami()}  # fmt: skip
        folder = pending_dir(run_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            kept = folder / f"{created.replace(':', '')}-{uuid.uuid4().hex[:12]}.json"
            fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(to_json(entry))
        except OSError as o:
            print(f"gpuwise: warning: not recorded: {e} (nor kept for later: {o.strerror or o})", file=sys.stderr)
            return None
        again = f"gpuwise runs sync {shlex.quote(run_dir)}" if run_dir else "gpuwise runs sync"
        print(f"gpuwise: warning: not recorded: {e}; kept in {kept}: `{again}` writes it later", file=sys.stderr)
        return None


MAX_PENDING_BYTES = 64 << 20  # a pending record is one command's JSON output: far below this


def _pending_entry(path: Path) -> dict:
    """A pending file as a record to write, or GpuwiseError saying why not: it may be planted or damaged."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise GpuwiseError(f"cannot read it: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise GpuwiseError("not a regular file")
        if info.st_size > MAX_PENDING_BYTES:
            raise GpuwiseError(f"{info.st_size:,} bytes, more than any record")
        raw = f.read()
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):
        raise GpuwiseError("not JSON") from None
    if not isinstance(entry, dict):
        raise GpuwiseError("not a JSON object")
    if entry.get("kind") not in RECORDED_KINDS:
        raise GpuwiseError(f"kind {str(entry.get('kind'))[:40]!r} is none of gpuwise's")
    for key in ("device", "name", "created"):
        if not isinstance(entry.get(key), str):
            raise GpuwiseError(f"its {key} is not text")
    if not isinstance(entry.get("data"), dict):
        raise GpuwiseError("its data is not a JSON object")
    if entry.get("run_dir") is not None and not isinstance(entry["run_dir"], str):
        raise GpuwiseError("its run_dir is not text")
    own_shape = entry["data"].get("traced") or entry["data"].get("task") == "serve"  # as `typed` skips them
    if entry["kind"] in KINDS and not (entry["kind"] == "plan" and own_shape):
        try:
            KINDS[entry["kind"]].load(entry["data"])
        except ValidationError as e:
            raise GpuwiseError(f"its data does not fit a {entry['kind']} record: {problem(e)}") from None
    return entry


def pending_files(folders: list[Path]) -> list[Path]:
    """The pending files under each folder: the folder's own, and those of the run directories in it."""
    found: list[Path] = []
    for folder in folders:
        for spool in (folder, folder / PENDING, *sorted(folder.glob(f"*/{PENDING}"))):
            if spool.is_dir() and not spool.is_symlink() and (spool.name in (PENDING, "pending")):
                found += sorted(p for p in spool.glob("*.json"))
    return list(dict.fromkeys(found))


def sync(folders: list[Path], path: str | Path | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """Write every pending record under `folders` (and the user's spool) to the record, each file removed once
    its row is in. Returns (written: (file, new id)), problems: one line per file left in place)."""
    written: list[tuple[Path, int]] = []
    problems: list[str] = []
    for file in pending_files([default_file().with_name("pending"), *folders]):
        try:
            entry = _pending_entry(file)
        except GpuwiseError as e:
            problems.append(f"{file}: skipped: {e}")
            continue
        who = {k: entry[k] if isinstance(entry.get(k), str) else None for k in ("user", "team")}
        new_id = record(
            entry["kind"], entry["device"], entry["name"], entry["data"], entry.get("run_dir"), path, entry["created"],
            who if who["user"] else None,
        )
        file.unlink()
        written.append((file, new_id))
    return written, problems


def copy(source: str | Path | None, target: str | Path) -> int:
    """Every row of one record into another (`gpuwise runs migrate --to`), ids and calibration kept. Refuses a
    target that already holds records: ids would collide, and merging two teams' records is not a copy."""
    if where(source).path is not None and not where(source).exists():
        raise GpuwiseError(f"no run record at {where(source)}")
    with connect(source) as src:
        kept = [dict(r._mapping) for r in src.execute(select(records).order_by(records.c.id))]
        cals = [dict(r._mapping) for r in src.execute(select(calibration_t))]
    with connect(target, write=True) as dst:
        if dst.execute(select(records.c.id).limit(1)).first() is not None:
            raise GpuwiseError(f"{where(target)} already holds records: migrate into an empty record")
        if kept:
            dst.execute(records.insert(), kept)
        if cals:
            dst.execute(calibration_t.insert(), cals)
        if kept and dst.dialect.name == "postgresql":  # the id sequence goes on after the copied ids
            dst.execute(text("SELECT setval(pg_get_serial_sequence('records', 'id'), (SELECT MAX(id) FROM records))"))
    return len(kept)
