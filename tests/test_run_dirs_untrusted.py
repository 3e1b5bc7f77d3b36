"""Issue #33, classes 3 and 4 and two inputs of class 8: a run directory is data. A config.yaml that names
code imports nothing, a package planted in a run directory never runs, a link or a FIFO among a run's files is
refused in one line (never followed, never waited on), deeply nested YAML is one line, non-ASCII digits in a
number flag are one line, and a damaged page of the run record gives the way back while `plan` still plans.

Real files (links, FIFOs, a damaged SQLite page), real processes of the `gpuwise` console script where the
Python path or a hang is what is tested; a tiny workload (tests/tiny_workload.py) trained once, in 2 steps."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest
import yaml

from gpuwise.cli import keep_run_dirs_off_path, main

TESTS = Path(__file__).resolve().parent
SCRIPT = Path(sys.executable).parent / "gpuwise"  # the console script pip wrote, as a user runs it
TINY = "tiny_workload:Tiny"
POINT = ",".join(["1"] * 4 + ["-1"] * 4)  # below the tiny workload's plane


def gpuwise(*argv) -> int:
    return main([str(a) for a in argv])


def one_line(capsys, argv, needle: str) -> str:
    """Exit 2 and one line on stderr holding `needle`."""
    code = gpuwise(*argv)
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished run of the tiny workload (2 steps, a checkpoint after each), copied by each test that changes it."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    with pytest.MonkeyPatch.context() as mp:  # a module fixture runs before conftest's private record
        mp.setenv("GPUWISE_DB", str(run.parent / "runs.sqlite"))
        argv = ["train", TINY, "--max-steps", "2", "--checkpoint-every", "1", "--accelerator", "cpu"]
        assert main([*argv, "--run-dir", str(run)]) == 0
    return run


def copy(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(run, tmp_path / name))


def unfinished(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    """A copy stopped after step 1: `train --resume` redoes step 2 and finishes it."""
    out = copy(run, tmp_path, name)
    shutil.rmtree(out / "checkpoints" / "step-000002")
    for f in ("summary.json", "model.safetensors"):
        (out / f).unlink()
    return out


def set_workload(run: Path, workload: str) -> None:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump(cfg | {"workload": workload}))


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return base | {"OMP_NUM_THREADS": "1"} | extra


def in_time(fn, seconds: float = 60):
    """fn() in a thread; a hang (an open of a FIFO) fails the test instead of stopping the suite."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still waiting after {seconds} s"
    return out[0]


# --- 3. Run directories name code --------------------------------------------------------------------------


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """An installed-looking module, outside any run directory, that leaves a marker when imported, as the one
    that launched a program did."""
    site, marker = tmp_path / "site", tmp_path / "launcher-imported"
    site.mkdir()
    (site / "launcher.py").write_text(f"open({str(marker)!r}, 'w').close()\n\nclass Evil:\n    pass\n")
    monkeypatch.syspath_prepend(str(site))
    yield marker
    sys.modules.pop("launcher", None)


@pytest.mark.parametrize("command", ["predict", "export", "serve", "resume", "ui page"])
def test_a_config_that_names_a_module_imports_nothing(tiny_run, tmp_path, capsys, launcher, command):
    run = copy(tiny_run, tmp_path)
    set_workload(run, "launcher:Evil")
    if command == "ui page":  # the page shows the config, and looks nothing up
        from gpuwise.ui.records import run_detail

        assert run_detail(run.name, tmp_path)["config"]["workload"] == "launcher:Evil"
    else:
        if command == "resume":
            (run / "summary.json").unlink()
        argv = {"predict": ["predict", run, POINT], "export": ["export", run], "serve": ["serve", run],
                "resume": ["train", "--resume", run]}[command]
        err = one_line(capsys, argv, "names the workload launcher:Evil, code that a run directory cannot choose")
        assert "nothing was imported" in err and "add --workload launcher:Evil" in err
    assert not launcher.exists() and "launcher" not in sys.modules


def test_your_own_workload_is_named_on_the_command_line_and_checked(tiny_run, tmp_path, capsys, launcher):
    one_line(capsys, ["predict", tiny_run, POINT], f"add --workload {TINY}")
    assert gpuwise("predict", tiny_run, POINT, "--workload", TINY, "--json") == 0
    (answer,) = json.loads(capsys.readouterr().out)
    assert answer["above"] is False
    one_line(capsys, ["predict", tiny_run, POINT], f"add --workload {TINY}")  # one command line does not carry over
    one_line(capsys, ["predict", tiny_run, POINT, "--workload", "launcher:Evil"],
             f"names the workload {TINY}, not --workload launcher:Evil")
    one_line(capsys, ["serve", tiny_run, "--workload", "launcher:Evil"],
             f"names the workload {TINY}, not --workload launcher:Evil")  # refused before a server starts
    assert not launcher.exists()

    exported = copy(tiny_run, tmp_path, "exported")
    assert gpuwise("export", exported, "--workload", TINY, "--json") == 0
    assert json.loads(capsys.readouterr().out)["max_abs_diff"] < 1e-5

    resumed = unfinished(tiny_run, tmp_path, "resumed")
    assert gpuwise("train", "--resume", resumed, "--workload", TINY) == 0
    assert "resuming" in capsys.readouterr().err and (resumed / "summary.json").is_file()
    one_line(capsys, ["train", TINY, "--workload", TINY, "--run-dir", tmp_path / "new"], "--workload confirms")


PLANTED = ("yaml", "torch", "typer", "rich")  # what gpuwise imports by name on the way to the refusal


@pytest.mark.parametrize("how", ["cwd inside it on PYTHONPATH", "PYTHONPATH", "python -m from it", "below it"])
def test_a_package_planted_in_the_run_directory_never_runs(tiny_run, tmp_path, how):
    """Each planted package writes a marker when imported. The user's own code (tests/, on PYTHONPATH) is
    still found, so the command succeeds: only the run directory left the path."""
    run, markers = copy(tiny_run, tmp_path), tmp_path / "markers"
    markers.mkdir()
    for name in PLANTED:
        (run / name).mkdir()
        (run / name / "__init__.py").write_text(f"open({str(markers / name)!r}, 'w').close()\n")
    script, cwd, path = {
        "cwd inside it on PYTHONPATH": ([str(SCRIPT)], run, f".{os.pathsep}{TESTS}"),
        "PYTHONPATH": ([str(SCRIPT)], tmp_path, f"{run}{os.pathsep}{TESTS}"),
        "python -m from it": ([sys.executable, "-m", "gpuwise"], run, str(TESTS)),  # -m puts the cwd first
        "below it": ([str(SCRIPT)], run / "checkpoints", f"..{os.pathsep}{TESTS}"),
    }[how]
    done = subprocess.run([*script, "predict", str(run), POINT, "--workload", TINY, "--json"], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env=env(PYTHONPATH=path, GPUWISE_DB=str(tmp_path / "r.sqlite")))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["above"] is False
    assert sorted(p.name for p in markers.iterdir()) == []


def test_only_run_directories_leave_the_path(tmp_path, monkeypatch):
    project, run, named = tmp_path / "project", tmp_path / "run", tmp_path / "named"
    for d in (project, run / "sub", named):
        d.mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 1\n")  # a project's own config: not a run
    (run / "config.yaml").write_text("workload: defects\n")
    (run / "metrics.jsonl").write_text("")
    (named / "config.yaml").write_text("workload: defects\n")  # no run files yet, but named as the run
    entries = [str(project), str(run), str(run / "sub"), str(named), str(TESTS)]
    monkeypatch.setattr(sys, "path", list(entries))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(entries))
    keep_run_dirs_off_path(["train", "--resume", str(named)])
    assert sys.path == [str(project), str(TESTS)]
    assert os.environ["PYTHONPATH"] == os.pathsep.join([str(project), str(TESTS)])


# --- 4. Links and special files in run directories ------------------------------------------------------------


def test_a_lock_that_is_a_link_is_refused_and_its_target_kept(tiny_run, tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    run = unfinished(tiny_run, tmp_path)
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(target)
    one_line(capsys, ["train", "--resume", run, "--workload", TINY], "a symbolic link")
    new = tmp_path / "new"  # "empty" but for the lock: a new run is refused the same way
    new.mkdir()
    (new / ".lock").symlink_to(target)
    one_line(capsys, ["train", TINY, "--run-dir", new, "--max-steps", "1"], "a symbolic link")
    assert target.read_text() == "precious"


def test_a_run_whose_checkpoints_are_a_link_is_not_resumed(tiny_run, tmp_path, capsys):
    """Resuming prunes old step-* directories: through a link, another directory's."""
    run, elsewhere = unfinished(tiny_run, tmp_path), tmp_path / "elsewhere"
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before = sorted(p.name for p in elsewhere.iterdir())
    one_line(capsys, ["train", "--resume", run, "--workload", TINY], "its checkpoints is a symbolic link")
    assert sorted(p.name for p in elsewhere.iterdir()) == before and not (run / "summary.json").exists()


def test_temp_files_that_are_links_are_replaced_never_written_through(tiny_run, tmp_path, capsys):
    run = unfinished(tiny_run, tmp_path)
    targets = {}
    for name in (".config.yaml.tmp", ".summary.json.tmp", ".metrics.jsonl.tmp"):
        targets[name] = tmp_path / f"target{name}"
        targets[name].write_text(f"precious {name}")
        (run / name).symlink_to(targets[name])
    assert gpuwise("train", "--resume", run, "--workload", TINY) == 0, capsys.readouterr().err
    for name, target in targets.items():
        assert target.read_text() == f"precious {name}"
        assert not (run / name).exists() and not (run / name).is_symlink()
    for name in ("config.yaml", "summary.json", "metrics.jsonl"):
        assert (run / name).is_file() and not (run / name).is_symlink()
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


@pytest.mark.parametrize("name, make, needle", [
    (".lock", fifo, "not a regular file"),
    ("metrics.jsonl", fifo, "not a regular file (a FIFO)"),
    ("metrics.jsonl", dev_zero, "a symbolic link"),
    ("config.yaml", dev_zero, "a symbolic link"),
])
def test_special_run_files_do_not_hang_resume(tiny_run, tmp_path, name, make, needle):
    run = unfinished(tiny_run, tmp_path)
    make(run / name)
    done = subprocess.run([str(SCRIPT), "train", "--resume", str(run), "--workload", TINY], capture_output=True,
                          text=True, timeout=120, env=env(PYTHONPATH=str(TESTS), GPUWISE_DB=str(tmp_path / "r.sqlite")))
    ours = [line for line in done.stderr.splitlines() if line.startswith("gpuwise:")]  # Lightning's own lines aside
    assert done.returncode == 2 and len(ours) == 1 and needle in ours[0], done.stderr
    assert "Traceback" not in done.stderr


def test_the_ui_lists_runs_with_special_files_and_each_page_is_a_400_at_worst(tiny_run, tmp_path):
    from fastapi.testclient import TestClient

    from gpuwise.ui.app import create_app

    runs = tmp_path / "runs"
    broken = {
        "fifo-lock": (lambda r: fifo(r / ".lock"), None),
        "fifo-metrics": (lambda r: fifo(r / "metrics.jsonl"), "not a regular file"),
        "zero-metrics": (lambda r: dev_zero(r / "metrics.jsonl"), "a symbolic link"),
        "linked-summary": (lambda r: (r / "summary.json").unlink() or (r / "summary.json").symlink_to(
            tiny_run / "summary.json"), "a symbolic link"),
        "deep-yaml": (lambda r: (r / "config.yaml").write_text("[" * 100_000), "nested deeper than"),
    }
    for name, (damage, _) in broken.items():
        damage(copy(tiny_run, runs, name))
    client = TestClient(create_app(runs_dir=runs), base_url="http://127.0.0.1:8300")
    listed = in_time(lambda: client.get("/api/runs"))
    assert listed.status_code == 200 and sorted(r["key"] for r in listed.json()) == sorted(broken)
    for name, (_, needle) in broken.items():
        got = in_time(lambda name=name: client.get(f"/api/runs/{name}"))
        if needle is None:
            assert got.status_code == 200 and got.json()["curves"]["loss"], got.text
        else:
            assert got.status_code == 400 and needle in got.json()["error"], (name, got.text)


def test_the_run_file_reader_is_bounded(tmp_path):
    from gpuwise.errors import GpuwiseError
    from gpuwise.files import run_file_lines, write_atomic

    log = tmp_path / "metrics.jsonl"
    with open(log, "wb") as f:  # a line of 3 MB with no newline (a planted file of zeros), then a real one
        f.write(b"\0" * 3_000_000 + b"\n" + b'{"step": 1}\n' + b'{"step": 2')
    assert list(run_file_lines(log, "run file", "a log", limit=10**7)) == ['{"step": 1}\n', '{"step": 2']
    with pytest.raises(GpuwiseError, match="over 1 MiB"):
        list(run_file_lines(log, "run file", "a log", limit=2**20))

    target = tmp_path / "target"
    target.write_text("kept")
    (tmp_path / ".out.json.tmp").symlink_to(target)
    write_atomic(tmp_path / "out.json", "{}")
    assert target.read_text() == "kept" and (tmp_path / "out.json").read_text() == "{}"


# --- 3. YAML has a depth limit ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "[" * 100_000,
    "{a: " * 50_000,
    "- " * 5_000 + "x\n",
    "".join(f"{'  ' * i}k{i}:\n" for i in range(200)) + "  " * 200 + "v\n",
], ids=["flow sequences", "flow mappings", "block sequences", "block mappings"])
def test_deeply_nested_yaml_is_one_line(tiny_run, tmp_path, capsys, text):
    run = copy(tiny_run, tmp_path)
    (run / "config.yaml").write_text(text)
    one_line(capsys, ["predict", run, POINT, "--workload", TINY], "nested deeper than 32 levels")


# --- 8. Non-ASCII digits in number flags; a damaged page in the run record ------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["train", TINY, "--seed", "٣"], "--seed"),
    (["train", TINY, "--epochs", "١٠"], "--epochs"),
    (["train", TINY, "--max-steps", "３"], "--max-steps"),
    (["train", TINY, "--micro-batch-size", "²"], "--micro-batch-size must be a positive integer or auto"),
    (["train", TINY, "--micro-batch-size", "٣"], "--micro-batch-size must be a positive integer or auto"),
    (["serve", "runs/x", "--port", "３"], "--port"),
    (["plan", "--model", "tinyllama-1.1b", "--gpus", "٣"], "--gpus"),
    (["runs", "show", "٣"], "record"),
])
def test_non_ascii_digits_in_number_flags_are_one_line(tmp_path, capsys, argv, needle):
    one_line(capsys, [*argv, *(["--run-dir", tmp_path / "run"] if argv[0] == "train" else [])], needle)
    assert not (tmp_path / "run").exists()


def damage(path: Path, table: str) -> None:
    """A real record (plans, a bench calibration), then one page of `table` overwritten: for the records, a
    page in the middle of them; for the calibration, its only page."""
    from gpuwise.runs import db

    for i in range(200):
        db.record("plan", "cpu", f"model-{i}", {"i": i, "pad": "x" * 400}, path=path)
    db.calibrate("cuda:a100-80gb", {"matmul.bf16": 0.7}, 1, path=path)
    with closing(sqlite3.connect(path)) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
        size = con.execute("PRAGMA page_size").fetchone()[0]
        pages = con.execute("PRAGMA page_count").fetchone()[0]
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'calibration'").fetchone()[0]
    page = pages // 2 if table == "records" else root
    with open(path, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\xa5" * size)


@pytest.mark.parametrize("table", ["records", "calibration"])
def test_a_damaged_record_is_one_line_with_the_way_back_and_plan_still_plans(tmp_path, monkeypatch, capsys, table):
    path = tmp_path / "runs.sqlite"
    monkeypatch.setenv("GPUWISE_DB", str(path))
    damage(path, table)
    if table == "records":
        for argv in (["runs"], ["runs", "compare"]):  # each reads every row
            err = one_line(capsys, argv, f"the run record {path} is damaged (database disk image is malformed)")
            assert f'sqlite3 {path} ".recover" | sqlite3' in err and "https://sqlite.org/recovery.html" in err
        # a record on a page that is whole is still shown: `runs show` reads its own row only
        assert main(["runs", "show", "1"]) == 0 and json.loads(capsys.readouterr().out)["name"] == "model-0"
    assert main(["plan", "--model", "tinyllama-1.1b", "--gpu", "a100-80gb", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["gpu"] == "a100-80gb"
    warnings = [line for line in err.splitlines() if "warning" in line]
    # A damaged calibration costs the plan its calibration, and says so once (nor is the plan recorded); a damaged
    # records page may cost the plan its record, said once, if the new row's insert meets that page.
    assert len(warnings) == 1 if table == "calibration" else len(warnings) <= 1, err
    assert all(f"the run record {path} is damaged" in w for w in warnings)
    if table == "calibration":
        assert "planning without bench calibration" in warnings[0] and json.loads(out)["record_id"] is None
