"""What every command shares: the console, the --json and --catalog options, and the one JSON printer."""

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
        "--json` rows; see README). Repeatable; also GPUWISE_CATALOG=FILE[:FILE].",
        metavar="FILE",
    ),
]


def emit(data: Any) -> None:
    """--json: standard JSON on stdout (files.to_json: inf and nan as null), the only way a command prints it."""
    from gpuwise.files import to_json

    sys.stdout.write(to_json(data, indent=2) + "\n")


def load_catalog(files: list[Path] | None):
    from gpuwise.hardware.catalog import load_catalog as load

    return load(files)
