"""Human output: rich tables for hardware, devices and plans. JSON output never passes here."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from gpuwise.hardware.catalog import Catalog, price_age
from gpuwise.hardware.devices import Devices
from gpuwise.results import PlanFields, PlanResult, TracedPlan

GiB = 2**30


def gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n < 1000 * GiB else f"{n / 2**40:,.1f} TiB"


def hours(h: float) -> str:
    if h < 1 / 60:
        return f"{h * 3600:.0f} s"
    if h < 1:
        return f"{h * 60:.0f} min"
    if h < 48:
        return f"{h:.1f} h"
    if h < 24 * 365:
        return f"{h / 24:.1f} days"
    return f"{h / 24 / 365:.1f} years"


def usd(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"${x / 1e6:,.2f} M"
    return f"${x:,.2f}" if x < 1000 else f"${x:,.0f}"


def count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _purchase(on) -> str:
    """An on-prem estimate's purchase price as quoted, and its share of one GPU where it is a server's."""
    if on.purchase_usd is None or not on.purchase_gpus:  # a record from before they were kept
        return f"{on.item}, {usd(on.purchase_usd_per_gpu)}/GPU"
    quoted = f"{usd(on.purchase_usd)} for {on.item}"
    per = f" / {on.purchase_gpus} GPUs = {usd(on.purchase_usd_per_gpu)}/GPU" if on.purchase_gpus > 1 else ""
    return quoted + per


def dated(as_of: str) -> str:
    return "undated" if as_of == "undated" else f"as of {as_of}"


def opt(x, fmt="{:g}") -> str:
    return "-" if x is None else fmt.format(x)


def render_hardware(console: Console, catalog: Catalog) -> None:
    t = Table(title="Accelerator catalog (dense peaks; `gpuwise hardware SLUG` for every source)")
    for col in (
        "slug",
        "name",
        "memory",
        "GB/s",
        "FP32",
        "BF16",
        "FP8",
        "TDP W",
        "cheapest cloud $/GPU-h",
        "buy $/GPU",
    ):
        t.add_column(col, justify="left" if col in ("slug", "name") else "right")
    for a in catalog.accelerators.values():
        prices = catalog.prices(a.slug)
        cloud = f"{prices[0].usd_per_gpu_hour:.2f} ({prices[0].provider})" if prices else "-"
        buy = catalog.purchase_price(a.slug)
        t.add_row(
            a.slug,
            a.name,
            f"{a.mem_gb:g} GiB",
            f"{a.mem_bw_gbs:g}",
            opt(a.fp32_tflops),
            opt(a.bf16_tflops),
            opt(a.fp8_tflops),
            opt(a.tdp_w),
            cloud,
            usd(buy.usd_per_gpu) if buy else "-",
        )
    console.print(t)
    console.print(
        "TFLOPS are dense (no sparsity). Memory in GiB as vendors count HBM/GDDR. "
        "Rows not marked otherwise come from the built-in catalog (src/gpuwise/hardware/data); `gpuwise hardware SLUG` "
        "gives each row's sources and their dates."
    )


def render_accelerator(console: Console, catalog: Catalog, slug: str) -> None:
    a = catalog.get(slug)
    t = Table(title=f"{a.name} ({a.slug})", show_header=False)
    t.add_column("field")
    t.add_column("value")
    for label, value in (
        ("memory", f"{a.mem_gb:g} GiB"),
        ("bandwidth", f"{a.mem_bw_gbs:g} GB/s"),
        ("FP32 / TF32", f"{opt(a.fp32_tflops)} / {opt(a.tf32_tflops)} TFLOPS"),
        ("BF16 / FP16 / FP8 dense", f"{opt(a.bf16_tflops)} / {opt(a.fp16_tflops)} / {opt(a.fp8_tflops)} TFLOPS"),
        ("INT8 dense", f"{opt(a.int8_tops)} TOPS"),
        ("TDP", f"{opt(a.tdp_w)} W"),
        ("interconnect", a.interconnect),
        ("NVLink domain / per server", f"{a.nvlink_domain} / {a.max_per_node}"),
        ("launched", str(a.launch_year)),
        ("spec source", f"{a.source} ({dated(a.as_of)}; {a.origin})"),
    ):
        t.add_row(label, value)
    for p in catalog.prices(a.slug):
        t.add_row(
            f"cloud: {p.provider}", f"${p.usd_per_gpu_hour:.2f}/GPU-h, {p.kind} — {p.source} ({price_age(p.as_of)[0]})"
        )
    chosen = catalog.purchase_price(a.slug)
    for buy in (b for b in catalog.purchase if b.slug == a.slug):
        mark = " [used for on-prem]" if buy is chosen else ""
        t.add_row(
            "purchase",
            f"{buy.what} — {buy.source} ({price_age(buy.as_of)[0]}){mark}",
        )
    console.print(t)


def render_devices(console: Console, dev: Devices) -> None:
    c = dev.cpu
    t = Table(title="This machine", show_header=False)
    t.add_column("field")
    t.add_column("value")
    t.add_row("CPU", f"{c.model} ({c.arch}, {c.vendor})")
    t.add_row("cores", f"{c.cores} physical usable, {c.logical} logical")
    t.add_row("ISA", ", ".join(c.isa) or "-")
    t.add_row("AMX", "yes" if "amx_tile" in c.isa else "no")
    t.add_row("RAM", gib(c.ram_bytes))
    t.add_row("FP32 peak", c.derivation)
    if c.bf16_peak_gflops:
        t.add_row("BF16 peak", f"{c.bf16_peak_gflops:.0f} GFLOP/s ({c.bf16_rule})")
    else:
        t.add_row("BF16 peak", c.bf16_rule)
    for g in dev.cuda:
        peak = f", catalog peak {g.peak_bf16_tflops:g} TFLOPS bf16" if g.peak_bf16_tflops else ""
        t.add_row(
            f"cuda:{g.index}",
            f"{g.name}, {gib(g.memory_bytes)}, compute capability {g.compute_capability}, "
            f"bf16 {'yes' if g.bf16 else 'no'}, catalog: {g.catalog_slug or 'not in catalog'}{peak}",
        )
    if not dev.cuda:
        t.add_row("CUDA", "none" if dev.torch_version else "unknown (torch not installed)")
    t.add_row("MPS", "yes" if dev.mps else "no")
    d = dev.train_default()
    t.add_row("train would use", f"{d['accelerator']} x {d['devices']}, precision {d['precision']} ({d['why']})")
    console.print(t)


def render_plan(console: Console, res: PlanResult | dict, sweep: bool) -> None:
    res = PlanResult.load(res)
    m = res.model
    published = f", published {count(m.published_params)}" if m.published_params else ""
    task = res.task
    console.print(
        f"[bold]{m.name}[/]: {count(m.params or 0)} parameters{published} · task {task} · "
        f"{res.precision} · batch {res.batch} x seq {res.seq}"
        + (f" · trainable {count(res.trainable_params or 0)}" if task in ("lora", "qlora") else "")
    )
    if sweep:
        console.print("[bold]Every accelerator at the fewest GPUs that fit, cheapest first (↓: not comparable on "
                      "price, listed after)[/]")  # fmt: skip
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        for col, right in (
            ("GPU", False),
            ("GPUs", False),
            ("GiB/GPU", True),
            ("fits", False),
            ("time", True),
            ("cloud $", True),
            ("provider", False),
            ("on-prem $", True),
        ):
            # Only the provider may be cut short on a narrow terminal; figures never are.
            t.add_column(col, no_wrap=col != "provider", overflow="ellipsis", justify="right" if right else "left")
        for row in res.options:
            comp, on = row.compute, row.onprem
            cloud = min(row.cost, key=lambda c: c.usd) if row.cost else None
            mark = (" ★" if row.cheapest else "") + (" ⚡" if row.fastest else "") + (" ↓" if row.demoted else "")
            t.add_row(
                row.gpu + mark,
                _layout(row),
                f"{row.memory.total / GiB:.1f}",
                _fit_cell(row),
                hours(comp.wall_hours) if comp else "-",
                usd(cloud.usd) if cloud else "-",
                cloud.provider if cloud else "-",
                usd(on.usd) if on else "-",
            )
        console.print(t)
        demoted = sorted({row.demoted for row in res.options if row.demoted})
        console.print(
            "★ cheapest that fits, ⚡ fastest that fits"
            + (f", ↓ listed after the price order: {'; '.join(demoted)}" if demoted else "")
            + ". fits: share of memory left free. cloud $: the "
            "cheapest provider; on-prem $: purchase amortized + power (assumptions below). time: wall clock at that "
            "GPU count (more GPUs shorten it; GPU-hours and cost stay about the same). GPUs: DP data, "
            "Z ZeRO stage, TP tensor, PP pipeline parallel. `--json` gives every figure with its source."
        )
        if res.fits:
            console.print(f"Recommended: [bold]{res.gpus} x {res.gpu}[/]\n")
    _render_detail(console, res)
    if res.serving is not None:
        s = res.serving
        console.print(f"[bold]Serving[/]: engine {s.engine} ({s.why})" + (f"\n{s.summary}" if s.summary else ""))
        if s.command:
            server = "llama.cpp" if s.llama_cpp else "vLLM"
            console.print(f"the {server} server by hand: {s.command}", soft_wrap=True, markup=False)


def render_traced(console: Console, result: dict | TracedPlan) -> None:
    res = TracedPlan.load(result)
    mem, comp = res.memory, res.compute
    where = f"per GPU of {res.gpus} x {res.gpu} (FSDP)" if res.gpus > 1 else f"1 x {res.gpu}"
    console.print(f"[bold]{res.model.name}[/], traced on fake tensors · one training step · {res.precision} · {where}")
    t = Table(box=box.SIMPLE, pad_edge=False, show_header=False)
    t.add_column("part")
    t.add_column("GiB", justify="right")
    for part in ("weights", "gradients", "optimizer", "activations", "overhead"):
        t.add_row(part, gib(getattr(mem, part)))
    t.add_row("[bold]peak[/]", f"[bold]{gib(mem.total)}[/]", end_section=True)
    t.add_row("capacity", gib(res.capacity))
    console.print(t)
    console.print(
        ("[green]fits[/]" if res.fits else "[red]does not fit[/]")
        + "; the parts are what was live at the peak (torch MemTracker)"
    )
    console.print(
        f"Step: {comp.flops_per_step:.3g} FLOPs, {comp.bytes_per_step / 1e9:,.2f} GB moved; roofline "
        f"{comp.roofline_s * 1e3:,.2f} ms / efficiency {comp.efficiency:g} "
        f"({comp.efficiency_origin}) = {comp.step_time_s * 1e3:,.2f} ms"
    )
    console.print(f"[dim]{res.method}[/]")


def _fit_cell(row: PlanFields) -> str:
    if row.fits:
        return f"[green]✓ {1 - row.memory.total / row.capacity:.0%}[/]"
    if row.compute is None:
        return f"[red]✗ no {row.precision}[/]"
    return f"[red]✗ has {row.capacity / GiB:.0f}[/]"


def _layout(row: PlanFields) -> str:
    lay = row.layout
    parts = [str(row.gpus)]
    if lay.dp > 1:
        parts.append(f"DP{lay.dp}" + (f" Z{lay.zero}" if lay.zero else ""))
    if lay.tp > 1:
        parts.append(f"TP{lay.tp}")
    if lay.pp > 1:
        parts.append(f"PP{lay.pp}")
    return " ".join(parts)


def _render_detail(console: Console, res: PlanResult) -> None:
    mem, comp = res.memory, res.compute
    console.print(f"[bold]{res.gpus} x {res.gpu_name}[/] ({res.layout.text}): memory per GPU")
    t = Table(box=box.SIMPLE, pad_edge=False, show_header=False)
    t.add_column("part")
    t.add_column("GiB", justify="right")
    for part in ("weights", "gradients", "optimizer", "activations", "kv_cache", "overhead"):
        t.add_row(part.replace("_", " "), gib(getattr(mem, part)))
    t.add_row("[bold]total[/]", f"[bold]{gib(mem.total)}[/]", end_section=True)
    t.add_row("capacity", gib(res.capacity))
    console.print(t)
    console.print(
        ("[green]" if res.fits else "[red]")
        + res.why
        + "[/]"
        + (f"; largest batch that fits: {res.max_batch}" if res.max_batch else "")
    )
    if res.kv_cache_per_token:
        console.print(f"KV cache: {res.kv_cache_per_token / 2**10:,.0f} KiB per token ({res.precision})")
    if comp:
        console.print(
            f"Compute: {comp.flops:.3g} FLOPs for {count(comp.tokens)} tokens ({comp.tokens_origin}); "
            f"{comp.peak_tflops:g} TFLOPS peak x efficiency {comp.efficiency:g} "
            f"({comp.efficiency_origin})"
        )
        line = (
            f"Time: {hours(comp.wall_hours)} wall, {comp.gpu_hours:,.1f} GPU-hours, {comp.tokens_per_s:,.0f} tokens/s"
        )
        if comp.decode_step_s:
            line += (
                f"; first token after {(comp.prefill_s or 0) * 1000:,.0f} ms, then {1 / comp.decode_step_s:,.0f} "
                f"tokens/s per sequence ({comp.decode_bound}-bound)"
            )
        console.print(line)
    if res.cost or res.onprem:
        console.print("[bold]Cost of the job[/]")
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("provider", "$/GPU-h", "total", "source (as of)"):
            t.add_column(col)
        for c in res.cost:
            t.add_row(c.provider, f"{c.usd_per_gpu_hour:.2f}", usd(c.usd), f"{c.source} ({price_age(c.as_of)[0]})")
        on = res.onprem
        if on:
            be = on.breakeven_utilization
            t.add_row(
                "on-prem",
                f"{on.usd_per_gpu_hour:.2f}",
                usd(on.usd),
                f"{_purchase(on)} — {on.source} ({price_age(on.as_of)[0]})",
            )
            console.print(t)
            console.print(
                "Buying beats the cheapest rental above "
                + (f"{be:.0%} utilization" if be else "no utilization")
                + " over the hardware's life"
                + ("" if be is None or be <= 1 else " (never: renting wins)")
            )
        else:
            console.print(t)
    for w in res.warnings:
        console.print(f"[yellow]! {w}[/]")
    console.print("[dim]Assumptions:[/]")
    for a in res.assumptions:
        given = a.origin.startswith("--")
        console.print(f"[dim]  {a.name}: " + (f"{a.value:g} (given)" if given else a.origin) + "[/]")


def _ms(s: float) -> str:
    return f"{s * 1000:,.0f} ms" if s < 10 else f"{s:,.0f} s"


def render_capacity(console: Console, res: dict) -> None:
    """`gpuwise plan --task serve`: every accelerator's replicas for the traffic, the cheapest starred, and the
    hosted APIs beside them."""
    m, tr, tg = res["model"], res["traffic"], res["targets"]
    q = f"p{tg['percentile']:g}"
    console.print(
        f"[bold]{m['name']}[/]: {count(m['params'])} parameters · serve · {res['precision']} · "
        f"{tr['rps']:.3g} requests/s ({tr['source']}) · prompts {tr['prompt_tokens']:,} and answers "
        f"{tr['output_tokens']:,} tokens · targets: TTFT {_ms(tg['ttft'])} and TPOT {_ms(tg['tpot'])} for "
        f"{tg['percentile']:g} % of requests · up {res['hours_per_day']:g} h a day",
        soft_wrap=True,
    )
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for col, right in (
        ("GPU", False),
        ("replicas", False),
        ("goodput/rep", True),
        ("busy", True),
        (f"TTFT {q}", True),
        (f"TPOT {q}", True),
        ("binds", False),
        ("$/hour", True),
        ("$/month", True),
        ("$/M out", True),
        ("priced at", False),
    ):
        t.add_column(col, no_wrap=col not in ("priced at", "binds"), justify="right" if right else "left")
    for o in res["options"]:
        if not o["meets"]:
            continue
        at = o["at_traffic"]
        t.add_row(
            o["gpu"] + (" ★" if o["cheapest"] else ""),
            f"{o['replicas']}" + (f" x TP {o['tp']}" if o["tp"] > 1 else "") + (" PCIe" if o["slow_link"] else ""),
            f"{o['goodput_per_replica']:.3g}/s",
            f"{o['concurrency']}",
            _ms(at[f"ttft_{q}"]),
            _ms(at[f"tpot_{q}"]),
            o["binds"],
            usd(o["usd_per_hour"]),
            usd(o["usd_per_month"]),
            usd(o["usd_per_m_output"]),
            o["cheapest_provider"] or "no price",
        )
    console.print(t)
    missed = [o for o in res["options"] if not o["meets"]]
    if missed:
        console.print(
            "Cannot meet the targets: " + "; ".join(f"{o['gpu']} ({o['why']})" for o in missed), soft_wrap=True
        )
    console.print(
        "replicas: copies of the model, each on one GPU or TP tensor-parallel GPUs (PCIe: over PCIe, its time too "
        "optimistic, ranked last); the engine: vLLM on GPUs, on this CPU the one `gpuwise bench --serve` measured. "
        "goodput/rep: requests/s one replica serves "
        f"with {tg['percentile']:g} % of them within both targets (DistServe's goodput). busy: most requests in one "
        f"replica at once at this traffic. TTFT, TPOT: at this traffic, simulated. binds: what fails first above "
        "the goodput. $/month: the GPUs up every hour of --hours-per-day, at the cheapest price (cloud, or on-prem: "
        "purchase over its life + power). $/M out: per million output tokens at this traffic. ★ cheapest that meets "
        "the targets. `--json` adds every price, the latency-against-load curve and the sources.",
        soft_wrap=True,
    )
    best = next((o for o in res["options"] if o["cheapest"]), None)
    if best:
        console.print(
            f"Recommended: [bold]{best['gpus']} x {best['gpu']}[/] ({best['replicas']} replica"
            f"{'s' if best['replicas'] > 1 else ''}), "
            f"{usd(best['usd_per_month'])} a month ({best['cheapest_provider']})"
        )
    if res["hosted"]:
        console.print(f"[bold]Hosted APIs serving {m['name']}[/] (the same traffic, a month):")
        for h in res["hosted"][:6]:
            be = h.get("breakeven_rps")
            verdict = (
                (f"GPUs cheaper above {be:.3g} requests/s" if be is not None else "the API is cheaper at any traffic")
                if best
                else ""
            )
            console.print(
                f"  {h['provider']:<16} {usd(h['usd_per_month']):>10}  (${h['usd_in']:g} in, ${h['usd_out']:g} out "
                f"per M, {dated(h['as_of'])}){'  ' + verdict if verdict else ''}",
                soft_wrap=True,
            )
    else:
        console.print(f"No hosted API in gpuwise's table serves {m['name']} (plan/data/hosted_prices.csv).")
    if res["closed"]:
        cheap = res["closed"][0]
        console.print(
            f"Closed models for comparison: {cheap['api_model']} ({cheap['provider']}) {usd(cheap['usd_per_month'])} "
            f"a month; {res['closed'][-1]['api_model']} {usd(res['closed'][-1]['usd_per_month'])}.",
            soft_wrap=True,
        )
    console.print("[dim]Assumptions: " + "; ".join(res["assumptions"]) + "[/]", soft_wrap=True)
