"""`gpuwise runs`: the record of every plan, bench and training run, and how good the estimates were."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from gpuwise.cli.options import JsonOpt, console, emit
from gpuwise.errors import GpuwiseError

app = typer.Typer(
    help="The record (SQLite, or a team's PostgreSQL) of every plan, bench and run: list, show, compare, sync, export.",
    no_args_is_help=False,
    rich_markup_mode=None,  # as the main app: "[...]" in help text is text
)


def _db():
    """The record's module: imported on first use, so `gpuwise --help` and the other commands start
    without SQLAlchemy."""
    from gpuwise.runs import db  # here, not at the top: see above

    return db


def _headline(r: dict[str, Any]) -> str:
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.results import BenchResult, LaunchRecord, PlanResult, TrainSummary

    db = _db()

    try:
        result = db.typed(r)
    except GpuwiseError:  # one damaged record must not hide the others
        return f"damaged (gpuwise runs show {r['id']})"
    if isinstance(result, TrainSummary):
        ev = {k: v for k, v in result.eval.items() if isinstance(v, int | float) and k not in ("n", "users")}
        first = next(iter(ev.items()), None)
        line = f"{result.steps} steps" + (f", {first[0]} {first[1]:.4g}" if first else "")
        base = result.baseline.metrics.get(first[0]) if first else None
        if isinstance(base, int | float):  # a result means little without what guessing scores
            line += f" ({result.baseline.name or 'baseline'} {base:.4g})"
        if result.wall_s:
            line += f", {result.wall_s:,.0f} s"
        return line
    if isinstance(result, PlanResult):
        hours = result.compute.gpu_hours if result.compute else 0
        return f"{result.task}: {result.gpus} x {result.gpu}, fits {result.fits}, {hours:,.1f} GPU-h"
    if isinstance(result, LaunchRecord):
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.launch.status import headline

        return headline(result)
    if isinstance(result, BenchResult):
        return ", ".join(f"{k} {len(v.workloads)} workloads" for k, v in result.devices.items())
    d = r["data"]
    if r["kind"] == "bench-serve":  # a serving engine's steps measured here
        f = d.get("fit") if isinstance(d.get("fit"), dict) else {}
        points = len(d.get("points") or [])
        return f"{d.get('engine')} steps: {float(f.get('a') or 0) * 1e3:.2f} ms + per token, {points} points"
    if r["kind"] == "serve":  # a serving session: what it met, and what the plan expected at that traffic
        a = d.get("actual") if isinstance(d.get("actual"), dict) else {}
        p = d.get("planned") if isinstance(d.get("planned"), dict) else {}
        line = (
            f"served {a.get('requests')} at {_num(a.get('rate_rps'))} req/s: TTFT p50 {_num(a.get('ttft_p50'))} s, "
            f"TPOT p50 {_num(a.get('tpot_p50'))} s"
        )
        if p:
            line += f" (planned {_num(p.get('ttft_p50'))} s, {_num(p.get('tpot_p50'))} s)"
        return line
    if d.get("task") == "serve":  # a serving capacity plan: the recommended option
        best = next((o for o in d.get("options", []) if isinstance(o, dict) and o.get("cheapest")), None)
        rps = (d.get("traffic") or {}).get("rps")
        if best is None:
            return f"serve {rps} req/s: no option meets the targets"
        return (
            f"serve {rps} req/s: {best.get('gpus')} x {best.get('gpu')}, ${best.get('usd_per_month') or 0:,.0f}/month"
        )
    # a traced plan: its figures are per step, not per job
    return f"{d.get('gpus')} x {d.get('gpu')}, fits {d.get('fits')}, traced"


def _num(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, int | float) else "-"


@app.callback(invoke_without_command=True)
def runs(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List every recorded plan, bench and training run."""
    if ctx.invoked_subcommand:
        return
    db = _db()

    rows = db.rows()
    if as_json:
        emit([{k: v for k, v in r.items() if k != "data"} for r in rows])
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"run record: {db.where()}", title_justify="left")
    for col in ("id", "kind", "when (UTC)", "device", "name", "result"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["id"]), r["kind"], r["created"], r["device"], r["name"], _headline(r))
    console.print(t)


@app.command()
def show(record_id: Annotated[int, typer.Argument(help="A record id from `gpuwise runs`.")]) -> None:
    """Everything recorded for one plan, bench or run (its JSON)."""
    db = _db()

    row = db.get(record_id)
    if row["kind"] == "launch":  # the job as it is now: its state, and its summary once it has finished
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.launch.status import status
        from gpuwise.results import LaunchRecord

        row["data"] |= status(db.load_data(row, LaunchRecord))
    emit(row)


@app.command()
def compare(as_json: JsonOpt = False) -> None:
    """The error of every estimate over all recorded training runs: (estimate - actual) / actual."""
    db = _db()

    rows = db.compare()
    if as_json:
        emit(rows)
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="plan vs actual over recorded runs", title_justify="left")
    for col in ("id", "workload", "device", "memory error", "step-time error", "step time calibrated by"):
        t.add_column(col, justify="right" if "error" in col else "left")
    for r in rows:
        t.add_row(
            str(r["id"]),
            r["workload"],
            r["device"],
            _signed(r["memory_error"]),
            _signed(r["step_time_error"]),
            (r["step_time_basis"] or "-")[:60],
        )
    console.print(t)


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


@app.command()
def sync(
    folders: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Run directories, or folders of them (runs/), whose records could not be written when they "
            "finished. The user's own pending records are always included.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the records that were kept for later because the record was down (each file removed once in)."""
    db = _db()

    for folder in folders or []:
        if not folder.is_dir():
            raise GpuwiseError(f"{folder}: not a directory (give run directories or the folder holding them)")
    written, problems = db.sync(list(folders or []))
    for line in problems:
        print(f"gpuwise: warning: {line}", file=sys.stderr)
    if as_json:
        emit({"written": [{"file": str(f), "record_id": i} for f, i in written], "skipped": problems})
        return
    for file, new_id in written:
        console.print(f"record #{new_id} written to {db.where()} (from {file})")
    if not written:
        console.print(f"nothing pending for {db.where()}" + (f"; {len(problems)} file(s) skipped" if problems else ""))


@app.command()
def export(
    mlflow: Annotated[str, typer.Option(help="The MLflow tracking server (http://HOST:5000).", metavar="URI")],
    ids: Annotated[
        list[int] | None, typer.Argument(help="Training record ids [every training run].", show_default=False)
    ] = None,
    experiment: Annotated[str, typer.Option(help="The MLflow experiment runs go into.")] = "gpuwise",
    as_json: JsonOpt = False,
) -> None:
    """Training runs as MLflow runs: parameters, metrics per step, plan against actual, artifacts. Runs exported
    before (same record id, same record) are left as they are."""
    # here, not at the top: `gpuwise --help` and the other commands start without MLflow's client
    from gpuwise.report.mlflow import export as to_mlflow

    done = to_mlflow(mlflow, ids or None, experiment)
    if as_json:
        emit(done)
        return
    for row in done:
        console.print(f"record #{row['record_id']}: MLflow run {row['mlflow_run_id']} ({row['state']})")
    if not done:
        console.print("no training runs in the record")


@app.command()
def migrate(
    to: Annotated[
        str | None,
        typer.Option(
            help="Copy every record into this (empty) record, ids kept: postgresql://USER@HOST/DB or a file.",
            metavar="URL",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Bring the record to this gpuwise's schema (done on first use anyway), or copy it whole --to another."""
    db = _db()

    if to is None:
        revision = db.migrate()
        if as_json:
            emit({"record": str(db.where()), "revision": revision})
        else:
            console.print(f"{db.where()}: at schema revision {revision}")
        return
    if str(db.where(to)) == str(db.where()):
        raise GpuwiseError("--to names the record being migrated: give another one")
    n = db.copy(None, to)
    if as_json:
        emit({"record": str(db.where()), "to": str(db.where(to)), "copied": n})
        return
    copied = f"{n} record{'' if n == 1 else 's'} copied from {db.where()} to {db.where(to)}"
    console.print(f"{copied}, ids kept; point gpuwise at it with --db or GPUWISE_DB")
