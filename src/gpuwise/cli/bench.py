"""`gpuwise bench`: a thin wrapper over gpuwise.bench, with its tables."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from gpuwise.cli.options import CatalogOpt, JsonOpt, console, emit, load_catalog
from gpuwise.errors import GpuwiseError

if TYPE_CHECKING:
    from gpuwise.results import BenchResult


def _pct(x: float | None) -> str:
    """A share of peak; one above 100 % is starred, and the table's note says why."""
    return "-" if x is None else f"{x:.0%}" + ("*" if x > 1 else "")


def render(con: Console, result: BenchResult | dict) -> None:
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.results import BenchResult

    result = BenchResult.load(result)
    for dev, r in result.devices.items():
        con.print(f"[bold]{dev}[/]: {r.peak.name} — peak: {r.peak.origin}")
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("test", "achieved", "of peak"):
            t.add_column(col, justify="left" if col == "test" else "right")
        for name, m in r.matmul.items():
            t.add_row(f"matmul {name} {m.n}x{m.n}", f"{m.tflops * 1e3:,.1f} GFLOP/s", _pct(m.fraction_of_peak))
        bw = r.bandwidth
        t.add_row("bandwidth copy", f"{bw.copy_gbs:,.1f} GB/s", "")
        t.add_row("bandwidth triad", f"{bw.triad_gbs:,.1f} GB/s", _pct(bw.fraction_of_peak))
        if r.host_device is not None:
            hd = r.host_device
            t.add_row("host -> device", f"{hd.h2d_gbs:,.1f} GB/s", _pct(hd.fraction_of_peak))
            t.add_row("device -> host", f"{hd.d2h_gbs:,.1f} GB/s", "")
        for name, w in r.workloads.items():
            extra = f", {w.tokens_per_s:,.0f} tokens/s" if w.tokens_per_s is not None else ""
            t.add_row(
                f"{name} step ({w.precision}, batch {w.batch})",
                f"{w.samples_per_s:,.1f} samples/s{extra}",
                _pct(w.fraction_of_peak),
            )
        con.print(t)
        shares = [m.fraction_of_peak for m in r.matmul.values()] + [w.fraction_of_peak for w in r.workloads.values()]
        shares += [r.bandwidth.fraction_of_peak, r.host_device.fraction_of_peak if r.host_device else None]
        if any(x is not None and x > 1 for x in shares):
            con.print(f"[dim]* above 100 %: the device ran faster than the clock its peak counts ({r.peak.origin}); "
                      "a CPU's boost clock runs above the one it reports[/]")  # fmt: skip
        if r.peak.bandwidth_origin:
            con.print(f"[dim]bandwidth peak: {r.peak.bandwidth_origin}[/]")
    for target, ratios in (result.speedup or {}).items():
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=f"{target} vs cpu", title_justify="left")
        t.add_column("test")
        t.add_column("speed-up", justify="right")
        for name, x in ratios.items():
            t.add_row(name, f"{x:,.1f}x")
        con.print(t)
    if result.projections is not None:
        bases = {v.basis for p in result.projections.values() for v in p.matmul.values()}
        bases |= {w.basis for p in result.projections.values() for w in p.workloads.values()}
        con.print("[dim]projected, not measured (no GPU here): " + "; ".join(sorted(bases)) + "[/]")


def bench(
    device: Annotated[str, typer.Option(help="cpu, cuda:N, or all (every device here).")] = "all",
    quick: Annotated[bool, typer.Option("--quick", help="Smaller sizes: under a minute on 2 CPU cores.")] = False,
    out: Annotated[Path | None, typer.Option(help="Where bench.json and bench.png go [runs/bench-TIME].")] = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(help="Time this workload's training step (repeatable) [every workload installed]."),
    ] = None,
    precision: Annotated[
        str,
        typer.Option(
            help="The workload steps' precision, and the one their calibration plans: auto (what `gpuwise train` "
            "picks here), 32-true or bf16-mixed."
        ),
    ] = "auto",
    serve: Annotated[
        str | None,
        typer.Option(
            help="Measure instead the step times of the engine serving this language model here (a named base, a "
            "model directory, a .gguf), for `gpuwise plan --task serve`.",
            rich_help_panel="Serving (--serve)",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(help="With --serve: gpuwise, vllm or llama.cpp.", rich_help_panel="Serving (--serve)"),
    ] = "gpuwise",
    dtype: Annotated[
        str | None,
        typer.Option(
            help="With --serve: the served dtype (gpuwise serve --dtype).", rich_help_panel="Serving (--serve)"
        ),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            help="With --serve on gpuwise's engine: the weights it holds (gpuwise serve --weights: auto, bf16, int8, "
            "int4); the plan reads a measurement for the weights a server holds.",
            rich_help_panel="Serving (--serve)",
        ),
    ] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """CPU vs GPU, timed: matmul per dtype, memory bandwidth, host<->device copies and a training
    step of each workload, each as a fraction of the device's peak; a PNG chart beside the JSON.

    With --serve MODEL: the serving engine's prefill and decode steps on this machine, through `gpuwise serve`,
    fitted to the step `gpuwise plan --task serve` simulates, and recorded for it.
    """
    if serve is not None:
        return _serve(serve, engine, dtype, quick, workload, as_json, weights)
    if engine != "gpuwise" or dtype is not None or weights is not None:
        raise GpuwiseError("--engine, --dtype and --weights apply to --serve MODEL")
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.bench.chart import draw
    from gpuwise.bench.run import parse_devices, run_bench
    from gpuwise.results import BenchFiles
    from gpuwise.runs.db import TIMED_PRECISIONS, workload_key

    if precision not in ("auto", *TIMED_PRECISIONS):
        raise GpuwiseError(f"--precision {precision}: must be one of auto, {', '.join(TIMED_PRECISIONS)}")
    cat = load_catalog(catalog)
    parse_devices(device)  # a wrong --device or --workload is refused before a directory is made for it
    if workload:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.workloads.registry import get

        for name in workload:
            get(name)
    out = out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    try:  # before the minutes of measuring, not after them
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise GpuwiseError(f"--out {out}: a file of that name exists; give a directory") from None
    except OSError as e:  # under a file, no permission, a read-only file system
        raise GpuwiseError(f"--out {out}: cannot create the directory: {e.strerror}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise GpuwiseError(f"--out {out}: the directory is not writable")
    status = Console(stderr=True)
    with status.status("benchmarking") as spinner:
        result = run_bench(device, quick, cat, lambda msg: spinner.update(msg), workload, precision)
    try:
        png = draw(result.dump(), out / "bench.png")
    except OSError as e:  # a full disk, or the directory removed while bench ran
        raise GpuwiseError(f"cannot write {out / 'bench.png'}: {e.strerror}") from None
    result.files = BenchFiles.build({"json": str(out / "bench.json"), "png": str(png)})
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.files import to_json
    from gpuwise.runs import db as rundb

    keys = [r.key for r in result.devices.values()]
    result.record_id = rundb.try_record("bench", ", ".join(keys), "bench", result.dump(), run_dir=str(out))
    if result.record_id is not None:
        for r in result.devices.values():  # what plan and train use for this device from now on
            fractions = {f"matmul.{k}": m.fraction_of_peak for k, m in r.matmul.items()}
            # Keyed by the precision the step ran at: a bf16 step's share of peak plans an fp32 run badly
            # (docs/plan.md). A step torch counts no FLOPs in (embedding lookups) is timed per sample and
            # per parameter; one it counts FLOPs in, per step and per FLOP.
            for k, w in r.workloads.items():
                timed = {"s_per_sample": w.s_per_sample, "s_per_param": w.s_per_param, "s_per_step": w.s_per_step}
                timed["flop_fraction"] = w.flop_fraction
                prefix = workload_key(k, w.precision)
                fractions |= {f"{prefix}.{u}": v for u, v in timed.items() if v is not None}
                if w.tflops:
                    fractions[prefix] = w.fraction_of_peak
            rundb.calibrate(r.key, fractions, result.record_id)
    try:
        (out / "bench.json").write_text(to_json(result.dump(), indent=2) + "\n")
    except OSError as e:  # a full disk, or the directory removed while bench ran
        raise GpuwiseError(f"cannot write {out / 'bench.json'}: {e.strerror}") from None
    if as_json:
        emit(result.dump())
    else:
        render(console, result)
        console.print(f"wrote {result.files.json_path} and {result.files.png}")


def _serve(
    model: str, engine: str, dtype: str | None, quick: bool, workload, as_json: bool, weights: str | None = None
) -> None:
    """`gpuwise bench --serve MODEL`: bench/serving.py, recorded and printed."""
    if engine not in ("gpuwise", "vllm", "llama.cpp"):
        raise GpuwiseError(f"--engine {engine}: must be one of gpuwise, vllm, llama.cpp")
    if weights is not None and weights not in ("auto", "bf16", "int8", "int4"):
        raise GpuwiseError(f"--weights {weights}: choose auto, bf16, int8, int4")
    if weights is not None and engine != "gpuwise":
        raise GpuwiseError(f"--weights is gpuwise's engine's; {engine} serves the weights it is given")
    if quick or workload:
        raise GpuwiseError("--quick and --workload apply to the device bench, not to --serve")
    if not model.strip():
        raise GpuwiseError("--serve needs a model: a named base, a model directory or a .gguf")
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.bench.serving import bench_serve
    from gpuwise.hardware.cpu import detect_cpu
    from gpuwise.runs import db as rundb

    status = Console(stderr=True)
    with status.status("measuring the serving engine") as spinner:
        data = bench_serve(model, engine, dtype, detect_cpu().model, lambda msg: spinner.update(msg), weights)
    data["record_id"] = rundb.try_record("bench-serve", "cpu", model, data)
    if as_json:
        emit(data)
        return
    f = data["fit"]
    console.print(f"[bold]{model}[/] on {data['host']} ({data['cores']} cores), engine {engine}: {data['method']}")
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("step", "streams", "prompt", "measured", "fitted", "error"):
        t.add_column(col, justify="left" if col == "step" else "right")
    for p in data["points"]:
        what = "time to first token" if p["kind"] == "prefill" else "time per output token"
        err = p["fitted"] / p["seconds"] - 1
        t.add_row(what, str(p["rows"]), str(p["prompt"]), f"{p['seconds'] * 1e3:.2f} ms", f"{p['fitted'] * 1e3:.2f} ms",
                  f"{err:+.0%}")  # fmt: skip
    console.print(t)
    console.print(
        f"step = {f['a'] * 1e3:.3f} ms + {f['b'] * 1e6:.3f} us x tokens + {f['c'] * 1e9:.3f} ns x context read "
        f"+ {f['d'] * 1e12:.3f} ps x attention pairs + {f.get('e', 0.0) * 1e3:.3f} ms x sequences sampling; a "
        f"request's time outside the steps {f['request_s'] * 1e3:.2f} ms"
    )
    if data["record_id"] is not None:
        console.print(
            f"recorded as #{data['record_id']}: `gpuwise plan --model {model} --task serve --gpu cpu` uses it"
        )
