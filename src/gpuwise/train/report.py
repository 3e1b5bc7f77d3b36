"""The end of a run, as a manager reads it: quality against the baseline and the published figure,
speed, plan against actual, and what the same run would take and cost on a few catalog GPUs."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from gpuwise.hardware.catalog import load_catalog
from gpuwise.hardware.reference import CONV_GPUS, LAMBDA_RESNET50, LAMBDA_SOURCE, PROJECT_ON, RESNET50_TRAIN_FLOPS, GiB
from gpuwise.plan.request import EFFICIENCY
from gpuwise.results import GpuProjection, TrainSummary
from gpuwise.runs.db import TIMED_PRECISIONS


def projection(summary: TrainSummary, convolutional: bool) -> list[GpuProjection]:
    """The run's counted FLOPs at the rate each GPU sustains, in the precision `gpuwise train` would
    pick there: for a CNN the rate Lambda measured on ResNet-50; for the rest the dense peak x the
    default efficiency. A projection, not a measurement; none when torch counts no FLOPs (embeddings)."""
    flops = (summary.flops_per_step or 0) * summary.steps
    if not flops:
        return []
    catalog = load_catalog()
    conv = convolutional
    out = []
    for slug in CONV_GPUS if conv else PROJECT_ON:
        acc = catalog.get(slug)
        if conv:
            rate = LAMBDA_RESNET50[slug][1] * RESNET50_TRAIN_FLOPS
            basis = f"{LAMBDA_SOURCE}: {LAMBDA_RESNET50[slug][1]} img/s x {RESNET50_TRAIN_FLOPS / 1e9:.1f} GFLOP"
        else:
            peak = acc.bf16_tflops or acc.fp16_tflops
            assert peak is not None, f"{slug}: PROJECT_ON lists only GPUs with a dense fp16/bf16 peak"
            rate = peak * 1e12 * EFFICIENCY.value
            basis = f"dense peak x {EFFICIENCY.value} ({EFFICIENCY.origin})"
        seconds = flops / rate
        row = {
            "gpu": slug,
            "seconds": seconds,
            "precision": "bf16-mixed" if acc.bf16_tflops else "16-mixed",
            "sustained_tflops": rate / 1e12,
            "basis": basis,
        }
        prices = catalog.prices(slug)
        if prices:
            row |= {
                "usd": seconds / 3600 * prices[0].usd_per_gpu_hour,
                "provider": prices[0].provider,
                "usd_per_gpu_hour": prices[0].usd_per_gpu_hour,
                "as_of": prices[0].as_of,
            }
        out.append(GpuProjection.build(row))
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(console: Console, summary: TrainSummary | dict) -> None:
    """A run's summary in the terminal: quality against its baselines, speed, plan against actual, the same
    run projected onto catalog GPUs, and any out-of-memory retries."""
    s = TrainSummary.load(summary)
    console.print(
        f"[bold]{s.workload}[/]: {s.steps} steps ({s.epochs:.1f} epochs) on {s.device}, "
        f"{s.precision}, global batch {s.global_batch} = micro-batch {s.micro_batch} x "
        f"{s.accumulation} accumulation · run dir {s.run_dir}"
    )
    _quality(console, s)
    if not s.steps:
        console.print("[dim]no training step of its own: it scored and saved what its parts learned[/]")
        return
    _speed(console, s)
    _plan_vs_actual(console, s)
    _projection(console, s)
    for e in s.oom_events:
        console.print(f"[yellow]! out of memory at step {e.step}: micro-batch {e.from_} -> {e.to}[/]")


def _quality(console: Console, s: TrainSummary) -> None:
    ev, base = s.eval, s.baseline
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("quality (held out)")
    t.add_column("this run", justify="right")
    t.add_column(base.name or "baseline", justify="right")
    also = base.also
    for name in also:
        t.add_column(name, justify="right")
    published = s.published
    if published:
        t.add_column("published", justify="right")
    for key, value in ev.items():
        skip = ("n", "threshold", "users", "eval_tokens")
        if isinstance(value, int | float) and not isinstance(value, bool) and key not in skip:
            row = [key, _fmt(value, ".4g"), _fmt(base.metrics.get(key), ".4g")]
            row += [_fmt(other.get(key), ".4g") for other in also.values()]
            if published:
                row.append(_fmt(published.get(key), ".4g"))
            t.add_row(*row)
    console.print(t)
    for name, other in also.items():
        if other.get("skipped"):
            console.print(f"[dim]{name}: skipped: {other['skipped']}[/]")
    if ev.get("threshold_origin"):
        console.print(f"[dim]decision threshold {ev['threshold_origin']}[/]")
    if published:
        console.print(f"[dim]published: {published.get('source')}[/]")
    for key in ("model", "loss"):  # what trained, where a workload has several
        if isinstance((s.data or {}).get(key), str):
            console.print(f"[dim]{key}: {s.data[key]}[/]")
    for text in ev.get("samples", []):
        console.print(f"[dim]sample:[/] {text}")
    for name, part in ((s.data or {}).get("parts") or {}).items():  # the runs it was assembled from
        scores = ", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in part.items() if k != "wall_s")
        console.print(f"[dim]part {name}: {scores}; {_fmt(part.get('wall_s'), ',.0f')} s (run dir parts/{name})[/]")


def _speed(console: Console, s: TrainSummary) -> None:
    tp = s.throughput
    speed = f"{tp.samples_per_s:,.1f} samples/s" if tp.samples_per_s else "-"
    if tp.tokens_per_s:
        speed += f", {tp.tokens_per_s:,.0f} tokens/s"
    if s.mfu:
        mfu = f"{s.mfu:.1%} of peak ({s.peak_flops.origin})"
    elif not s.flops_per_step:
        mfu = "MFU n/a: torch's FLOP counter sees no matmuls here (embedding lookups and elementwise math only)"
    else:
        mfu = f"MFU n/a: {s.peak_flops.origin}"
    wall = f"; {s.wall_s:,.0f} s of training, wall clock" if s.wall_s else ""
    console.print(f"Speed: {speed}; {mfu}{wall}")


def _plan_vs_actual(console: Console, s: TrainSummary) -> None:
    plan, actual, err = s.plan, s.actual, s.estimate_error
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="plan vs actual", title_justify="left")
    for col in ("", "plan", "actual", "error"):
        t.add_column(col, justify="right" if col else "left")
    pk, ak = plan.peak_bytes, actual.peak_bytes
    t.add_row(
        "peak memory",
        _fmt(pk and pk / GiB, ".2f") + " GiB",
        _fmt(ak and ak / GiB, ".2f") + " GiB",
        _fmt(err.peak_bytes, "+.0%"),
    )
    t.add_row(
        "step time",
        _fmt(plan.step_time_s, ".3f") + " s",
        _fmt(actual.step_time_s, ".3f") + " s",
        _fmt(err.step_time_s, "+.0%"),
    )
    console.print(t)
    console.print(f"[dim]plan: {plan.method}; actual memory: {actual.method}[/]")
    if actual.process_peak_bytes:
        console.print(
            f"[dim]process memory: {actual.process_peak_bytes / GiB:.2f} GiB (resident growth over the steps + "
            "weights: the allocator's cache and library buffers too, what to size a machine by)[/]"
        )
    if plan.efficiency_origin:
        console.print(f"[dim]plan efficiency {plan.efficiency:.3g}: {plan.efficiency_origin}[/]")
    if plan.efficiency_origin == EFFICIENCY.origin and s.device.startswith("cpu"):
        # a published GPU figure says little of a CPU's step: the plan's time is a guess until bench has run
        how = (
            f"`gpuwise bench --quick --precision {s.precision}` calibrates it for the next run"
            if s.precision in TIMED_PRECISIONS
            else f"bench times {' and '.join(TIMED_PRECISIONS)} steps only"
        )
        console.print(
            f"step time: planned at a GPU's published efficiency, not calibrated on this CPU at {s.precision}; {how}"
        )


def _projection(console: Console, s: TrainSummary) -> None:
    if not s.projection:
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="the same run elsewhere (projection)", title_justify="left")
    for col in ("GPU", "precision", "sustained", "time", "cost", "price"):
        t.add_column(col, justify="left" if col in ("GPU", "precision") else "right")
    for p in s.projection:
        priced = p.usd is not None
        price = f"{p.usd_per_gpu_hour:.2f} $/h {p.provider} ({p.as_of})" if priced else "no price"
        cost = f"${p.usd:.2g}" if priced else "-"
        t.add_row(p.gpu, p.precision, f"{p.sustained_tflops:.1f} TFLOPS", f"{p.seconds:.1f} s", cost, price)
    console.print(t)
    basis = s.projection[0].basis.split(":")[0]
    console.print(
        f"[dim]projection: this run's counted FLOPs / the rate each GPU sustains ({basis}); "
        "start-up and data loading not included[/]"
    )
