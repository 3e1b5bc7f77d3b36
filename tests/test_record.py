"""Issue #52: the team's record. The same suite on both back-ends (an SQLite file; a real PostgreSQL,
tests/engines/postgres_local.sh), an old SQLite record migrated to PostgreSQL with every row and id kept,
16 processes writing at once, a run whose record is down kept and synced later, and the password never
shown."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from gpuwise.errors import GpuwiseError
from gpuwise.runs import db
from gpuwise.runs.schema import HEAD

TESTS = Path(__file__).resolve().parent
GPUWISE = Path(sys.executable).parent / "gpuwise"  # the console script, as a user runs it
TINY = "tiny_workload:Tiny"
DOWN = "postgresql://gpuwise:hunter2-secret@127.0.0.1:1/gpuwise"  # nothing listens on port 1: a record that is down


@pytest.fixture(params=["sqlite", "postgresql"])
def record(request, tmp_path, monkeypatch) -> str:
    """The record this test writes: a new SQLite file, or a new database on the session's PostgreSQL."""
    url = str(tmp_path / "r.sqlite") if request.param == "sqlite" else request.getfixturevalue("postgres").database()
    monkeypatch.setenv("GPUWISE_DB", url)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))  # the user's pending spool, not the real one
    return url


def run(*argv: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 300):
    return subprocess.run([str(GPUWISE), *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, **(env or {})))  # fmt: skip


def one_line(done: subprocess.CompletedProcess, needle: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and needle in done.stderr, done.stderr
    return done.stderr


# --- the same suite, on both back-ends --------------------------------------------------------------------


def test_rows_come_back_whole_with_the_databases_ids(record):
    first = db.record("plan", "cuda:h100-sxm", "llama", {"task": "qlora", "n": 1})
    second = db.record("bench", "cpu:epyc", "bench", {"devices": {}}, run_dir="/runs/b")
    third = db.record("plan", "cuda:h200", "llama", {"task": "full", "nested": {"a": [1, 2.5, None]}})
    assert first < second < third and len({first, second, third}) == 3
    rows = db.rows()
    assert [r["id"] for r in rows] == [first, second, third]
    assert [r["id"] for r in db.rows("plan")] == [first, third]
    got = db.get(third)
    assert got["data"] == {"task": "full", "nested": {"a": [1, 2.5, None]}} and got["device"] == "cuda:h200"
    assert db.get(second)["run_dir"] == "/runs/b"
    with pytest.raises(GpuwiseError, match=f"no record #{third + 100}"):
        db.get(third + 100)
    assert db.migrate() == HEAD


def test_calibration_keeps_one_row_per_key_and_a_newer_bench_replaces_only_its_own(record):
    rid = db.record("bench", "cuda:h100-sxm", "bench", {})
    db.calibrate("cuda:h100-sxm", {"matmul.bf16": 0.61, "matmul.fp32": 0.4, "bad": float("nan")}, rid)
    later = db.record("bench", "cuda:h100-sxm", "bench", {})
    db.calibrate("cuda:h100-sxm", {"matmul.bf16": 0.7}, later)
    found = db.calibration_map()
    assert set(found) == {("h100-sxm", "matmul.bf16"), ("h100-sxm", "matmul.fp32")}
    assert found[("h100-sxm", "matmul.bf16")][0] == 0.7 and f"record #{later}" in found[("h100-sxm", "matmul.bf16")][1]
    assert found[("h100-sxm", "matmul.fp32")][0] == 0.4 and f"record #{rid}" in found[("h100-sxm", "matmul.fp32")][1]
    assert db.calibration("cuda:h100-sxm", "matmul.fp32")[0] == 0.4
    assert db.calibration("cuda:h100-sxm", "missing") is None


def test_a_damaged_record_is_one_line_and_hides_no_other(record):
    good = db.record("plan", "cpu", "m", {"task": "x"})
    bad = db.record("plan", "cpu", "m", {"task": "y"})
    with db.connect(write=True) as con:  # hand-edited: the data is no longer a JSON object
        con.execute(text("UPDATE records SET data = '[1, 2' WHERE id = :i"), {"i": bad})
    assert db.get(good)["data"] == {"task": "x"}
    with pytest.raises(GpuwiseError, match=f"record #{bad} in .* is damaged"):
        db.get(bad)
    one_line(run("runs", "show", str(bad)), f"record #{bad}")


def test_sixteen_processes_writing_at_once_lose_nothing_and_mix_nothing(record, tmp_path):
    """16 processes x 30 records, and each process's calibration key rewritten 5 times, all at once."""
    writer = tmp_path / "writer.py"
    writer.write_text(textwrap.dedent("""
        import sys, time
        from gpuwise.runs import db
        me = int(sys.argv[1])
        while time.time() < float(sys.argv[2]):  # start together
            time.sleep(0.005)
        for i in range(30):
            rid = db.record("bench-serve", f"cpu:{me}", f"writer-{me}", {"writer": me, "i": i, "pad": "x" * (i * 37)})
            if i % 6 == 0:
                db.calibrate(f"cuda:w{me}", {"matmul.bf16": 0.1 + i / 100}, rid)
    """))
    start = __import__("time").time() + 8  # the 16 interpreters need a few seconds to import on 2 cores
    procs = [subprocess.Popen([sys.executable, str(writer), str(me), str(start)], stderr=subprocess.PIPE, text=True)
             for me in range(16)]  # fmt: skip
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    rows = db.rows("bench-serve")
    assert len(rows) == 16 * 30 and len({r["id"] for r in rows}) == 16 * 30
    seen = {(r["data"]["writer"], r["data"]["i"]) for r in rows}
    assert seen == {(me, i) for me in range(16) for i in range(30)}
    for r in rows:  # every row whole, and its own writer's
        me, i = r["data"]["writer"], r["data"]["i"]
        assert r["name"] == f"writer-{me}" and r["device"] == f"cpu:{me}" and r["data"]["pad"] == "x" * (i * 37)
    cal = db.calibration_map()
    assert {k for k in cal} == {(f"w{me}", "matmul.bf16") for me in range(16)}
    assert all(abs(v[0] - 0.34) < 1e-9 for v in cal.values())  # each key's last write (i = 24), not another's


def test_runs_lists_the_record_and_shows_where_without_a_password(record, postgres):
    db.record("plan", "cpu", "m", {"task": "x"})
    if record.startswith("postgresql"):
        inline = record.replace("gpuwise@", f"gpuwise:{postgres.password}@")
        done = run("--db", inline, "runs")
        assert done.returncode == 0, done.stderr
        assert postgres.password not in done.stdout + done.stderr and "gpuwise:***@" in done.stdout
    done = run("runs", "--json")
    assert done.returncode == 0 and [r["kind"] for r in json.loads(done.stdout)] == ["plan"], done.stderr


# --- a record that is down ---------------------------------------------------------------------------------


def test_plan_and_runs_with_the_record_down_say_so_in_one_line(tmp_path):
    env = {"GPUWISE_DB": DOWN, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    done = run("runs", env=env)
    one_line(done, "cannot reach the run record postgresql://gpuwise:***@127.0.0.1:1/gpuwise")
    assert "hunter2" not in done.stderr
    done = run("plan", "--model", "llama-3.1-8b", "--task", "qlora", "--gpu", "h100-sxm", env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "hunter2" not in done.stderr, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("gpuwise: warning")]
    assert len(warnings) == 2 and "no measured calibration" in warnings[0] and "kept in" in warnings[1], warnings
    kept = list((tmp_path / "xdg" / "gpuwise" / "pending").glob("*.json"))
    assert len(kept) == 1 and "hunter2" not in kept[0].read_text() and (kept[0].stat().st_mode & 0o077) == 0
    one_line(run("--db", "mysql://u:hunter2@h/x", "runs"), "cannot be kept in mysql")
    one_line(run("--db", "postgresql://u@h:notaport/x", "runs"), "not a database URL")


@pytest.mark.slow
def test_a_run_finishes_with_its_record_down_and_runs_sync_writes_it(postgres, tmp_path):
    runs = tmp_path / "runs"
    env = {"GPUWISE_DB": DOWN, "PYTHONPATH": str(TESTS), "XDG_DATA_HOME": str(tmp_path / "xdg"), "OMP_NUM_THREADS": "1"}
    done = run("train", TINY, "--max-steps", "2", "--accelerator", "cpu", "--run-dir", str(runs / "a"), "--json",
               env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["record_id"] is None and (runs / "a" / "summary.json").is_file()
    said = [line for line in done.stderr.splitlines() if "not recorded" in line]
    assert len(said) == 1 and f"gpuwise runs sync {runs / 'a'}" in said[0] and "hunter2" not in done.stderr, said
    pending = list((runs / "a" / db.PENDING).glob("*.json"))
    assert len(pending) == 1
    created = json.loads(pending[0].read_text())["created"]

    live = postgres.database()
    env |= {"GPUWISE_DB": live}
    done = run("runs", "sync", str(runs), env=env)
    assert done.returncode == 0 and "record #1 written" in done.stdout, done.stdout + done.stderr
    assert not pending[0].exists()
    shown = json.loads(run("runs", "show", "1", env=env).stdout)
    assert shown["kind"] == "train" and shown["run_dir"] == str(runs / "a")
    # its figures whole, and the time it finished, not the time it was synced
    assert shown["data"] | {"record_id": None} == summary and shown["created"] == created
    again = run("runs", "sync", str(runs), env=env)
    assert again.returncode == 0 and "nothing pending" in again.stdout


def test_runs_sync_skips_planted_files_in_one_line_each_and_writes_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "run" / db.PENDING
    folder.mkdir(parents=True)
    good = {"kind": "bench-serve", "device": "cpu", "name": "m", "run_dir": None, "created": "2026-01-02T03:04:05Z",
            "data": {"engine": "gpuwise"}}  # fmt: skip
    (folder / "a-good.json").write_text(json.dumps(good))
    (folder / "b-link.json").symlink_to("/etc/passwd")
    (folder / "c-notjson.json").write_text("{nope")
    (folder / "d-kind.json").write_text(json.dumps(good | {"kind": "rm -rf"}))
    (folder / "e-shape.json").write_text(json.dumps(good | {"kind": "train", "data": {"steps": "many"}}))
    os.mkfifo(folder / "f-fifo.json")
    written, problems = db.sync([tmp_path / "run"])
    assert [f.name for f, _ in written] == ["a-good.json"] and not (folder / "a-good.json").exists()
    assert db.get(written[0][1])["created"] == "2026-01-02T03:04:05Z"  # when it ran, not when it was synced
    assert len(problems) == 5 and all("skipped" in p for p in problems), problems
    assert {p.split(":")[0].rsplit("/", 1)[1] for p in problems} == {
        "b-link.json", "c-notjson.json", "d-kind.json", "e-shape.json", "f-fifo.json"}
    assert (folder / "b-link.json").is_symlink() and (folder / "c-notjson.json").exists()  # left as they were
    one_line(run("runs", "sync", str(tmp_path / "no-such")), "not a directory")


# --- migrations, and an old record moved to PostgreSQL ------------------------------------------------------

OLD_SCHEMA = """
CREATE TABLE records (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, created TEXT NOT NULL,
    device TEXT NOT NULL, name TEXT NOT NULL, run_dir TEXT, data TEXT NOT NULL);
CREATE TABLE calibration (device TEXT NOT NULL, key TEXT NOT NULL, fraction REAL NOT NULL,
    record_id INTEGER NOT NULL REFERENCES records(id), updated TEXT NOT NULL, PRIMARY KEY (device, key));
"""


def old_record(path: Path) -> list[tuple]:
    """A record as gpuwise wrote it before migrations (the schema of 2026-11), with a gap in its ids."""
    with sqlite3.connect(path) as con:
        con.executescript(OLD_SCHEMA)
        rows = [(1, "plan", "2026-11-01T00:00:00Z", "cuda:h100-sxm", "llama", None, '{"task": "qlora"}'),
                (2, "bench", "2026-11-02T00:00:00Z", "cuda:h100-sxm", "bench", "/r/b", '{"devices": {}}'),
                (5, "train", "2026-11-03T00:00:00Z", "cpu:x", "defects", "/r/d", '{"workload": "x"}')]  # fmt: skip
        con.executemany("INSERT INTO records VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        con.execute("INSERT INTO calibration VALUES ('cuda:h100-sxm', 'matmul.bf16', 0.62, 2, '2026-11-02T00:00:00Z')")
    return rows


def all_rows(url: str) -> tuple[list[tuple], list[tuple]]:
    w = db.where(url)
    engine = create_engine(w.url)
    with engine.connect() as con:
        recs = [tuple(r) for r in con.execute(text("SELECT id, kind, created, device, name, run_dir, data FROM records "
                                                   "ORDER BY id"))]  # fmt: skip
        cals = [tuple(r) for r in con.execute(text("SELECT device, key, fraction, record_id, updated "
                                                   "FROM calibration"))]  # fmt: skip
    engine.dispose()
    return recs, cals


def test_an_old_sqlite_record_is_stamped_in_place_and_moves_to_postgresql_with_every_row(postgres, tmp_path):
    old = tmp_path / "old.sqlite"
    rows = old_record(old)
    before = all_rows(str(old))
    done = run("--db", str(old), "runs", "--json")
    assert done.returncode == 0 and [r["id"] for r in json.loads(done.stdout)] == [1, 2, 5], done.stderr
    assert all_rows(str(old)) == before  # opened, stamped at HEAD, nothing changed
    with sqlite3.connect(old) as con:
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]

    target = postgres.database()
    done = run("--db", str(old), "runs", "migrate", "--to", target)
    assert done.returncode == 0 and "3 records copied" in done.stdout, done.stdout + done.stderr
    recs, cals = all_rows(target)
    assert recs == rows and cals == [("cuda:h100-sxm", "matmul.bf16", 0.62, 2, "2026-11-02T00:00:00Z")]
    assert db.record("plan", "cpu", "m", {}, path=target) == 6  # the database's ids go on after the copied ones
    one_line(run("--db", str(old), "runs", "migrate", "--to", target), "already holds records")
    one_line(run("--db", str(old), "runs", "migrate", "--to", str(old)), "names the record being migrated")


def test_a_record_from_a_newer_gpuwise_is_refused_in_one_line(tmp_path):
    path = tmp_path / "new.sqlite"
    old_record(path)
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
        con.execute("INSERT INTO alembic_version VALUES ('9999')")
    one_line(run("--db", str(path), "runs"), "upgrade gpuwise")
    with sqlite3.connect(path) as con:  # and left as it was
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]


def test_another_programs_database_is_not_taken_for_a_record(postgres):
    url = postgres.database()
    engine = create_engine(db.where(url).url)
    with engine.begin() as con:
        con.execute(text("CREATE TABLE records (id INTEGER PRIMARY KEY, title TEXT)"))
    engine.dispose()
    one_line(run("--db", url, "runs"), "is not a gpuwise run record")


# --- the UI reads the same record --------------------------------------------------------------------------


def test_the_ui_lists_a_teammates_runs_from_the_shared_record(postgres, tmp_path, monkeypatch):
    url = postgres.database()
    monkeypatch.setenv("GPUWISE_DB", url)
    mate = tmp_path / "mate" / "run"
    mate.mkdir(parents=True)
    writer = textwrap.dedent(f"""
        from gpuwise.runs import db
        db.record("train", "cuda:h100-sxm", "defects", {{"workload": "defects", "run_dir": {str(mate)!r}}},
                  run_dir={str(mate)!r})
        db.record("bench", "cuda:h100-sxm", "bench", {{"devices": {{}}}})
    """)
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)  # another process: a teammate's node
    from gpuwise.ui.records import bench_rows, run_rows

    assert [r["key"] for r in bench_rows()] == ["2"]
    assert any(str(mate) in json.dumps(r, default=str) for r in run_rows(tmp_path / "mine"))
