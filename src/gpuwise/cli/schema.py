"""`gpuwise schema`: the JSON Schema of what `plan --json`, `plan --traced --json`, `train --json`
(summary.json) and `bench --json` (bench.json) print, for scripts that read them. docs/schema/ holds the
same text; a test keeps them equal."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Annotated

import typer

# Spelled out rather than read from gpuwise.results: the models are imported only when a command needs them.
Kind = StrEnum("Kind", ["plan", "traced", "train", "bench"])


EPILOG = "Example: gpuwise schema train > summary.schema.json"


def schema_text(kind: str) -> str:
    """The schema of one result, as `gpuwise schema KIND` prints it and docs/schema/KIND.json holds it."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.results import SCHEMAS

    return json.dumps(SCHEMAS[kind].model_json_schema(), indent=2, ensure_ascii=False) + "\n"


def schema(
    kind: Annotated[
        Kind,
        typer.Argument(
            help="plan (plan --json), traced (plan --traced --json), train (summary.json) or bench (bench.json)."
        ),
    ],
) -> None:
    """Print the JSON Schema of a result: every field, its type, and what it holds in which unit."""
    sys.stdout.write(schema_text(kind.value))
