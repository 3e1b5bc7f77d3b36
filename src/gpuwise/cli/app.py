"""The `gpuwise` command: the typer app, its global options, every command registered by name, and `main`.

Each command lives in its own module of this package and is registered here, explicitly: no command
registers itself on import, and no command module imports this one.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from gpuwise import __version__
from gpuwise.cli import bench, chat, export, fleet, hardware, launch, plan, report, runs, schema, serve, train, ui
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.cpu import retain_freed_memory

# typer vendors click since 0.20; reach its UsageError through a public class, whichever click it is.
UsageError: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")

app = typer.Typer(
    help="Know what an AI workload needs (memory, time, cost on every accelerator), then run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text: with rich markup on, every "[default]" of a help string was read as a tag and vanished.
    rich_markup_mode=None,
)


def _version(value: bool):
    if value:
        typer.echo(f"gpuwise {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            help="The run record: an SQLite file, or a team's postgresql://USER@HOST/DB (the password from "
            "~/.pgpass, PGPASSFILE or ?service=NAME, as psql) [user data dir; or GPUWISE_DB].",
            metavar="FILE|URL",
        ),
    ] = None,
):
    """Plan (memory, time, cost per accelerator), inspect this machine, train, bench, and keep the record."""
    if db is not None:
        os.environ["GPUWISE_DB"] = db  # one switch for every command of this invocation


app.command()(hardware.hardware)
app.command()(hardware.devices)
app.command(epilog=plan.EPILOG)(plan.plan)
app.command(epilog=train.EPILOG)(train.train)
app.command()(train.predict)
app.command(epilog=launch.EPILOG)(launch.launch)
app.command()(bench.bench)
app.command()(serve.serve)
app.command()(chat.chat)
app.command(epilog=export.EPILOG)(export.export)
app.add_typer(runs.app, name="runs")
app.command(epilog=fleet.EPILOG)(fleet.fleet)
app.command()(report.report)
app.command(epilog=schema.EPILOG)(schema.schema)
app.command()(ui.ui)


def main(argv: list[str] | None = None) -> int:
    """Entry point: bad input of any kind is one line on stderr and exit code 2, never a traceback."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.workloads.registry import forget_given

    # The Python path was cleaned when gpuwise.cli was imported, for this process's own command line; a
    # program calling main(argv) keeps its path as it set it.
    forget_given()  # what an earlier command line in this process named does not carry over
    # Whatever the umask (000 on some shared machines), nothing gpuwise writes is writable by others: a file in
    # its cache or a run directory is run or loaded later (llama-server, kernels, weights).
    os.umask(os.umask(0o022) | 0o022)
    command = typer.main.get_command(app)
    retain_freed_memory()
    try:
        command.main(args=argv, prog_name="gpuwise", standalone_mode=False)
    except GpuwiseError as e:
        print(f"gpuwise: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except UsageError as e:
        if not e.format_message():  # a bare `gpuwise`: the help was printed
            return 0
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        print(f"gpuwise: error: {_one_line(e.format_message())}{hint}", file=sys.stderr)
        return 2
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("gpuwise: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        # A bug, not bad input: still one line (and exit 1, not 2), the traceback only on request.
        if os.environ.get("GPUWISE_DEBUG"):
            raise
        print(
            f"gpuwise: error: internal error ({first_line(e)}); please report it, GPUWISE_DEBUG=1 shows where",
            file=sys.stderr,
        )
        return 1
    return 0


def _one_line(message: str) -> str:
    """A message that quotes a file or a library's error may span lines; the user gets them as one."""
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
