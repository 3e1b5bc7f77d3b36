"""What a run leaves behind: config.yaml, metrics.jsonl, TensorBoard events, summary.json; and the claim
on its directory.

Only rank 0 writes (and, with `train --mlflow`, logs to MLflow as it goes). Writes of whole files go
through a temp name and a rename, so a killed run never leaves half a summary. A run holds its directory
by an advisory lock for its whole life, so no two processes ever write one run, and never writes into a
directory that holds anything else.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from gpuwise.errors import GpuwiseError
from gpuwise.files import (
    MAX_METRICS_BYTES,
    open_lock_file,
    open_run_file_for_append,
    parse_yaml,
    read_run_file,
    run_file_lines,
    to_json,
    write_atomic,
)
from gpuwise.hardware.usage import USAGE_FILE, Sampler, probe_for
from gpuwise.train.config import TrainConfig
from gpuwise.train.mlflow_live import ENV_VAR as MLFLOW_ENV
from gpuwise.train.mlflow_live import LiveLog

LOCK = ".lock"
SUMMARY = "summary.json"  # written last, atomically: its presence is what "finished" means
METRICS = "metrics.jsonl"
RUN_DIRS = ("checkpoints", "tensorboard", "parts")  # what a run writes into, beside the files below
RUN_FILES = ("config.yaml", METRICS, SUMMARY)
MAX_CONFIG_BYTES = 1 << 20  # a config.yaml is a few hundred bytes: a larger one is not ours


def _oserror(what: str, e: OSError) -> GpuwiseError:
    return GpuwiseError(f"{what}: {e.strerror or e}")


class RunClaim:
    """A run directory held for the run's life by `flock` on RUN/.lock: a second process given the same
    directory is refused at once, and the lock goes with the process (kill -9 too), so a crash never
    leaves a stale lock to clear by hand."""

    def __init__(self, path: Path, created: bool, resumed: bool):
        self.path, self.created, self.resumed = path, created, resumed
        self._fd: int | None = None
        import fcntl

        fd = open_lock_file(path / LOCK, "the run's lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise GpuwiseError(
                f"{path} is in use by another gpuwise process (pid {holder}): wait for it, or pass another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    @classmethod
    def new(cls, cfg: TrainConfig) -> RunClaim:
        """`--run-dir` if given (absent, or an empty directory), else runs/WORKLOAD-TIME with -2, -3, ... when
        another run started in the same second (os.mkdir is atomic: exactly one process gets each name)."""
        if cfg.run_dir:
            path = Path(cfg.run_dir)
            created = not path.exists()
            _mkdir(path, exist_ok=True, flag="--run-dir")
            claim = cls(path, created, resumed=False)
            try:
                entries = sorted(e for e in os.listdir(path) if e != LOCK)
            except OSError as e:
                claim.release()
                raise _oserror(f"--run-dir {path}", e) from None
            if "config.yaml" in entries:
                claim.release()
                raise GpuwiseError(
                    f"{path} already holds a run: continue it with `gpuwise train --resume {path}` "
                    "or pass another --run-dir"
                )
            if entries:
                claim.release()
                shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
                raise GpuwiseError(
                    f"--run-dir {path} is not empty and is not a gpuwise run (it holds {shown}); nothing in it "
                    "was touched: pass an empty or new directory"
                )
            return claim
        stem = Path("runs") / f"{cfg.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
        _mkdir(stem.parent, exist_ok=True, flag="runs/")
        for n in range(1, 10_000):
            path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
            try:
                _mkdir(path, exist_ok=False, flag="runs/")
            except FileExistsError:
                continue
            return cls(path, created=True, resumed=False)
        raise GpuwiseError(f"{stem}: 10,000 runs started in the same second; pass --run-dir")

    @classmethod
    def resume(cls, run_dir: Path) -> RunClaim:
        if not run_dir.is_dir():
            raise GpuwiseError(f"--resume {run_dir}: no such run directory")
        if not (run_dir / "config.yaml").is_file():
            raise GpuwiseError(f"--resume {run_dir}: not a gpuwise run directory (no config.yaml)")
        # A run goes on writing into these, and prunes old step-* directories in checkpoints/: through a link
        # that would be another directory's files. gpuwise never makes one, so one is refused, not followed.
        for name in (*RUN_DIRS, *RUN_FILES):
            if (run_dir / name).is_symlink():
                raise GpuwiseError(
                    f"--resume {run_dir}: its {name} is a symbolic link, which a run directory gpuwise writes "
                    "never holds; nothing was written"
                )
        claim = cls(run_dir, created=False, resumed=True)
        if is_finished(run_dir):
            claim.release()
            raise GpuwiseError(
                f"--resume {run_dir}: the run has finished ({SUMMARY}); nothing to resume. "
                "Train on with a new run (--init-from, for a workload that warm-starts)"
            )
        return claim

    def discard_if_unused(self) -> None:
        """After a failure: a new run that wrote no checkpoint and logged no step holds nothing worth keeping,
        yet its config.yaml would block the same --run-dir. Remove what it wrote (the directory was absent
        or empty before). A resumed run is the user's and is kept."""
        if self.resumed or any((self.path / "checkpoints").glob("step-*")) or (self.path / "parts").is_dir():
            return  # parts: runs trained for this one (Workload.parts), which its --resume reuses
        metrics = self.path / METRICS
        try:
            if metrics.exists() and any('"loss"' in line for line in _metric_lines(metrics)):
                return
        except GpuwiseError:  # not a file this run wrote: not its own, so nothing is removed
            return
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for entry in self.path.iterdir():
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _mkdir(path: Path, exist_ok: bool, flag: str) -> None:
    try:
        if exist_ok:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path)
    except FileExistsError:
        if exist_ok:  # a file of that name
            raise GpuwiseError(f"{flag} {path}: a file of that name exists; pass a directory") from None
        raise
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise
        raise _oserror(f"{flag} {path}: cannot create the directory", e) from None


def load_config(run_dir: Path, resolve: bool = True) -> TrainConfig:
    """A run's saved config, checked as strictly as the flags it came from (the file is untrusted input);
    `resolve=False`: its workload is not looked up (TrainConfig.from_dict)."""
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        why = "a file" if run_dir.exists() else "no such directory"
        raise GpuwiseError(f"{run_dir} is not a gpuwise run directory ({why})")
    if not path.exists():
        raise GpuwiseError(f"{run_dir} is not a gpuwise run directory (no config.yaml)")
    text = read_run_file(path, "run config", "the config.yaml gpuwise train writes", limit=MAX_CONFIG_BYTES)
    data = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise GpuwiseError(f"{path} does not hold a config mapping")
    return TrainConfig.from_dict(data, where=str(path), run_dir=run_dir, resolve=resolve)


def is_run(path: Path) -> bool:
    """Whether `path` is a run directory (`gpuwise serve RUN` serves it; anything else names a model)."""
    return (path / "config.yaml").is_file()


def is_running(run_dir: Path) -> bool:
    """Whether a process holds the run's claim now (a run training, or being resumed)."""
    import fcntl

    try:
        fd = open_lock_file(run_dir / LOCK, "the run's lock", create=False)
    except GpuwiseError:  # no lock file (never claimed by this gpuwise), not readable, or not a file at all
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops a lock taken here too
    return False


def is_finished(run_dir: Path) -> bool:
    """Whether the run finished training: the one test, for resume, predict, serve, export and report.

    The loop writes summary.json last, after the trained model's files, through a temp name and a rename,
    so it is there whole or not at all. `os.path.isfile` rather than `Path.is_file`: it answers False,
    never raises, for a path the OS refuses (a name too long), on every Python this package supports."""
    return os.path.isfile(run_dir / SUMMARY)


def require_finished(run_dir: Path) -> None:
    if not is_finished(run_dir):
        raise GpuwiseError(
            f"{run_dir} has not finished training (no {SUMMARY}): `gpuwise train --resume {run_dir}` completes it"
        )


def open_finished(run_dir: Path) -> TrainConfig:
    """The config of a run that finished training, for predict, serve and export, resolved as train resolved
    it (`Workload.resolve`; a run recorded before that hook kept its options unset); one line if it is not one."""
    cfg = load_config(run_dir)
    require_finished(run_dir)
    return cfg.resolved()


def _metric_lines(path: Path):
    return run_file_lines(path, "run file", "the metrics.jsonl gpuwise train writes", MAX_METRICS_BYTES)


def _append(path: Path):
    return os.fdopen(open_run_file_for_append(path, "run file"), "a", encoding="utf-8")


class Recorder:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self._metrics = None
        self._tb = None
        self._live: LiveLog | None = None
        self._sampler: Sampler | None = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = _append(run_dir / METRICS)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            if os.environ.get(MLFLOW_ENV):  # gpuwise train --mlflow URI
                self._live = LiveLog(os.environ[MLFLOW_ENV], run_dir, run_dir.name)

    def rewind(self, step: int) -> None:
        """On resume from the checkpoint of `step`: drop what was logged after it (the steps about to be
        redone, and a line cut by a kill), so metrics.jsonl keeps one line per step, and TensorBoard too."""
        if not self.enabled:
            return
        assert self._metrics is not None and self._tb is not None  # both opened in __init__ when enabled
        self._metrics.close()
        path = self.run_dir / METRICS
        kept = []
        for line in _metric_lines(path):
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                kept.append(line.rstrip("\n") + "\n")
        write_atomic(path, "".join(kept))
        self._metrics = _append(path)
        from torch.utils.tensorboard import SummaryWriter

        self._tb.close()
        self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=step + 1)

    def watch(self, accelerator: str) -> None:
        """Sample the devices this run holds while it trains (hardware/usage.py): their summary goes into the
        run's summary and record, and RUN/usage.json holds the figures so far for `gpuwise fleet`."""
        if not self.enabled or self._sampler is not None:
            return
        probe, note = probe_for(accelerator)
        if note:
            print(f"gpuwise: warning: {note}", file=sys.stderr)
        usage_file = self.run_dir / USAGE_FILE
        self._sampler = Sampler(probe, on_flush=lambda summary: write_atomic(usage_file, to_json(summary) + "\n"))
        self._sampler.start()

    def usage(self) -> dict | None:
        """The devices' use over the run (this part of it, after a resume), sampling stopped; None on other ranks."""
        if self._sampler is None:
            return None
        return self._sampler.stop()

    def save_config(self, cfg: TrainConfig) -> None:
        if self.enabled:
            write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(cfg.as_dict(), sort_keys=False))

    def log(self, step: int, **values) -> None:
        """Every value to metrics.jsonl; to TensorBoard the loss and evaluations at every step, the rest
        every 10th (each scalar costs ~60 us of protobuf, which a small model's step would feel)."""
        if not self.enabled:
            return
        assert self._metrics is not None and self._tb is not None  # both opened in __init__ when enabled
        self._metrics.write(to_json({"step": step, **values}) + "\n")
        self._metrics.flush()
        if self._live is not None:
            self._live.log(step, values)
        for key, value in values.items():
            if isinstance(value, int | float) and (key == "loss" or key.startswith("eval/") or step % 10 == 0):
                self._tb.add_scalar(key, value, step)

    def summary(self, data: dict) -> None:
        if self.enabled:
            write_atomic(self.run_dir / SUMMARY, to_json(data, indent=2) + "\n")

    def close(self) -> None:
        if not self.enabled:
            return
        assert self._metrics is not None and self._tb is not None  # both opened in __init__ when enabled
        if not self._metrics.closed:
            self._metrics.close()
            self._tb.close()
        if self._live is not None:
            self._live.flush()
        if self._sampler is not None:
            self._sampler.stop()
