"""The command line: `cli.app` holds the typer app and `main`; one module per command.

Before anything else is imported, run directories are taken off the Python path (`keep_run_dirs_off_path`):
`python -m gpuwise` puts the current directory first on it, and PYTHONPATH may name a run directory, so a
package planted in one (say `yaml/` or `torch/`) would run its `__init__` at the first import of that name.
Only `os` and `sys` are used here: both are loaded before any user code, so neither can be a planted copy.
"""

import os
import sys

# A directory gpuwise trained in holds config.yaml and at least one of these (its lock, its log, its summary).
_RUN_FILES = (".lock", "metrics.jsonl", "summary.json")


def _holds_config(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.yaml"))


def _named_dirs(argv: list[str]) -> list[str]:
    """Every directory holding a config.yaml that the command line names (RUN, --resume RUN, --flag=RUN,
    --model NAME=RUN): the runs this command is about to read, whatever they hold besides."""
    named = []
    for token in argv:
        for candidate in {token, token.partition("=")[2]}:
            if candidate and os.path.isdir(candidate) and _holds_config(candidate):
                named.append(os.path.realpath(candidate))
    return named


def _inside_run(path: str, named: list[str]) -> bool:
    if any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in named):
        return True
    here = path
    while True:  # the entry itself or any directory above it
        if _holds_config(here) and any(os.path.lexists(os.path.join(here, f)) for f in _RUN_FILES):
            return True
        parent = os.path.dirname(here)
        if parent == here:
            return False
        here = parent


def keep_run_dirs_off_path(argv: list[str]) -> None:
    """Drop from sys.path, and from PYTHONPATH for any child process, each entry that is a run directory or
    lies inside one: those the command line names, and any that holds a run's files. '' and a relative
    entry are the current directory's. The user's own code on the path stays; a workload given as
    package.module:Class is looked for there."""
    named = _named_dirs(argv)

    def off(entry: str) -> bool:
        return _inside_run(os.path.realpath(entry or os.curdir), named)

    try:
        sys.path[:] = [e for e in sys.path if not (isinstance(e, str) and off(e))]
        if os.environ.get("PYTHONPATH"):
            entries = os.environ["PYTHONPATH"].split(os.pathsep)
            kept = [e for e in entries if not off(e)]
            if kept != entries:
                os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    except OSError:  # the current directory was removed under us: nothing of it can be imported anyway
        pass


keep_run_dirs_off_path(sys.argv[1:])

from gpuwise.cli.app import app, main  # noqa: E402 - only once the path is clean

__all__ = ["app", "main", "keep_run_dirs_off_path"]
