"""What every command shares: the console, the --json, --catalog and --workload options, and the one JSON
printer."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

# Piped output (CI logs, a README) would wrap at rich's 80-column default; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
CatalogOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--catalog",
        help="A CSV of your own accelerators or prices (same columns as `gpuwise hardware "
        "--json` rows; see docs/plan.md). Repeatable; also GPUWISE_CATALOG=FILE[:FILE].",
        metavar="FILE",
    ),
]


def _workload_named(value: str | None) -> str | None:
    if value:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.workloads.registry import name_given

        name_given(value, flag=True)
    return value


# A run's config.yaml may name a workload by its built-in or entry-point name; a package.module:Class it
# names is imported only when the user names it here too (a file in a run directory must not choose code
# to run). The callback tells the registry, so a command only declares the option.
WorkloadOpt = Annotated[
    str | None,
    typer.Option(
        "--workload",
        callback=_workload_named,
        metavar="PACKAGE.MODULE:CLASS",
        help="The workload the run was trained with, when it is your own package.module:Class (its config.yaml "
        "names it, but a run directory cannot choose code to import): checked against config.yaml.",
        show_default=False,
    ),
]


def emit(data: Any) -> None:
    """--json: standard JSON on stdout (files.to_json: inf and nan as null), the only way a command prints it."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.files import to_json

    sys.stdout.write(to_json(data, indent=2) + "\n")


def load_catalog(files: list[Path] | None):
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.hardware.catalog import load_catalog as load

    return load(files)
