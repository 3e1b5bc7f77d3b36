"""`gpuwise report`: a self-contained HTML page for a run, a recorded plan sweep, or a recorded bench."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli.options import JsonOpt, console, emit
from gpuwise.errors import GpuwiseError


def report(
    run_dir: Annotated[Path | None, typer.Argument(help="A finished `gpuwise train` run.")] = None,
    plan: Annotated[
        int | None,
        typer.Option(
            "--plan",
            help="A plan record id (`gpuwise runs`): its catalog sweep as cost against time, the Pareto front marked.",
        ),
    ] = None,
    bench: Annotated[int | None, typer.Option("--bench", help="A bench record id: its bars.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="The HTML file [RUN_DIR/report.html, or plan-ID.html / bench-ID.html here].")
    ] = None,
    json_out: JsonOpt = False,
):
    """Write an HTML report with its plots inlined: loss and metric curves, throughput, plan vs actual."""
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.report import html
    from gpuwise.runs import db

    chosen = [x is not None for x in (run_dir, plan, bench)]
    if sum(chosen) != 1:
        raise GpuwiseError("give exactly one of RUN_DIR, --plan ID or --bench ID")
    if run_dir is not None:
        if not run_dir.is_dir():
            raise GpuwiseError(f"{run_dir}: not a directory (a finished `gpuwise train` run is expected)")
        page, target = html.run_report(run_dir), out or run_dir / "report.html"
        figures = {"kind": "run", "run_dir": str(run_dir), **html.run_figures(run_dir)} if json_out else {}
    else:
        record_id = plan if plan is not None else bench
        assert record_id is not None  # one of --plan/--bench, checked above
        record = db.get(record_id)
        kind = "plan" if plan is not None else "bench"
        if record["kind"] != kind:
            raise GpuwiseError(f"record #{record_id} is a {record['kind']}, not a {kind}")
        try:
            page = html.plan_report(record) if kind == "plan" else html.bench_report(record)
            drawn: dict = {}
            if json_out:
                drawn = html.plan_figures(record) if kind == "plan" else {"rows": html.bench_rows(record)}
        except html.DAMAGED as e:
            raise GpuwiseError(f"record #{record_id} is damaged ({html.damaged(e)})") from None
        target = out or Path(f"{kind}-{record_id}.html")
        figures = {"kind": kind, "record_id": record_id, **drawn}
    try:
        target.write_text(page, encoding="utf-8")
    except OSError as e:  # under a file, a directory of that name, no permission, a full disk
        raise GpuwiseError(f"cannot write the report {target}: {e.strerror}") from None
    if json_out:
        emit({"report": str(target), **figures})
    else:
        console.print(f"wrote {target}")
