"""Self-contained HTML reports (PNG plots inlined as data URIs): a run, a plan sweep, a bench."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.report import plots

STYLE = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:right}
td:first-child,th:first-child{text-align:left}img{max-width:100%}.note{color:#666;font-size:90%}"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def _page(title: str, parts: list[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(parts)}</body></html>"
    )


# A long run logs a line per step: a million steps is ~200 MB. Past this, the file is not a metrics log.
MAX_METRICS_BYTES = 512 * 2**20


def _read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """summary.json and metrics.jsonl of a finished run, or one line saying which is missing or damaged."""
    from gpuwise.files import MAX_FILE_BYTES, read_text_file

    texts = {}
    for name, limit in (("summary.json", MAX_FILE_BYTES), ("metrics.jsonl", MAX_METRICS_BYTES)):
        try:
            found = (run_dir / name).exists()
        except OSError as e:  # a name too long
            raise GpuwiseError(f"{run_dir}: {e.strerror}") from None
        if not found:
            raise GpuwiseError(f"{run_dir}: not a finished gpuwise run ({name} is missing)")
        texts[name] = read_text_file(run_dir / name, "run file", f"the {name} gpuwise train writes", limit)
    metrics = texts["metrics.jsonl"].splitlines()
    rows = [_json_object(f"{run_dir / 'metrics.jsonl'}:{n}", line) for n, line in enumerate(metrics, 1) if line.strip()]
    return _json_object(str(run_dir / "summary.json"), texts["summary.json"]), rows


def _json_object(where: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise GpuwiseError(f"{where}: not a JSON object as gpuwise train writes it (truncated or edited?)")
    return value


# What a page builder raises when the JSON it reads parses but is not what gpuwise wrote (a field missing,
# a string where a number was): the files and the record are untrusted input, hand-edited or damaged.
DAMAGED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def damaged(e: Exception) -> str:
    """What was wrong, as few words: the missing field where there is one."""
    return f"no '{e.args[0]}'" if isinstance(e, KeyError) else f"a value of the wrong kind: {first_line(e)}"


def run_report(run_dir: Path) -> str:
    summary, rows = _read_run(run_dir)
    try:
        return _run_page(summary, rows)
    except DAMAGED as e:
        raise GpuwiseError(f"{run_dir}: not what gpuwise train writes ({damaged(e)})") from None


def _run_page(summary: dict, rows: list[dict]) -> str:
    train = [r for r in rows if "loss" in r]
    s, ev, base = summary, summary["eval"], summary.get("baseline", {})
    parts = [
        f"<p>{html.escape(s['device'])}, {html.escape(s['precision'])}, {s['steps']} steps "
        f"({s['epochs']:.1f} epochs), global batch {s['global_batch']} = micro-batch {s['micro_batch']} x "
        f"{s['accumulation']}; run directory <code>{html.escape(s['run_dir'])}</code></p>"
    ]
    keys = [k for k, v in ev.items() if isinstance(v, int | float) and k not in ("n", "users", "threshold")]
    published = s.get("data", {}).get("published", {})
    parts.append(
        "<h2>Quality on held-out data</h2>"
        + _table(
            ["metric", "this run", base.get("name", "baseline"), "published"],
            [[k, ev[k], base.get(k), published.get(k)] for k in keys],
        )
    )
    if published:
        parts.append(f"<p class='note'>published: {html.escape(published.get('source', ''))}</p>")
    if train:
        steps = [r["step"] for r in train]
        parts.append(
            "<h2>Training</h2>"
            + _img(
                plots.loss_curve(
                    steps,
                    [r["loss"] for r in train],
                    [r.get("lr") for r in train if "lr" in r],
                    f"{s['workload']}: loss and learning rate",
                ),
                "loss curve",
            )
        )
        parts.append(
            _img(
                plots.series(
                    steps,
                    [r["samples_per_s"] for r in train],
                    "samples / s",
                    "throughput per step (the first pays for warm-up)",
                ),
                "throughput",
            )
        )
    for key in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if len(pts) > 1:
            parts.append(
                _img(
                    plots.series(
                        [p[0] for p in pts], [p[1] for p in pts], key[5:], f"held-out {key[5:]} during training"
                    ),
                    key,
                )
            )
    plan, actual = s.get("plan", {}), s.get("actual", {})
    gib = 2**30
    parts.append(
        "<h2>Plan against actual</h2>"
        + _img(
            plots.plan_vs_actual(
                [
                    (
                        "peak memory",
                        plan.get("peak_bytes") and plan["peak_bytes"] / gib,
                        actual.get("peak_bytes") and actual["peak_bytes"] / gib,
                        "GiB",
                    ),
                    ("step time", plan.get("step_time_s"), actual.get("step_time_s"), "seconds"),
                ]
            ),
            "plan vs actual",
        )
    )
    parts.append(
        f"<p class='note'>plan: {html.escape(str(plan.get('method')))}; efficiency "
        f"{html.escape(str(plan.get('efficiency_origin')))}. actual memory: "
        f"{html.escape(str(actual.get('method')))}</p>"
    )
    if s.get("projection"):
        parts.append(
            "<h2>The same run on catalog GPUs (projection)</h2>"
            + _table(
                ["GPU", "precision", "sustained TFLOPS", "seconds", "USD", "price basis"],
                [
                    [
                        p["gpu"],
                        p["precision"],
                        p["sustained_tflops"],
                        p["seconds"],
                        p.get("usd"),
                        f"{p.get('provider', '-')} {p.get('as_of', '')}",
                    ]
                    for p in s["projection"]
                ],
            )
        )
        parts.append(f"<p class='note'>{html.escape(s['projection'][0]['basis'])}</p>")
    return _page(f"gpuwise run: {s['workload']}", parts)


def pareto_front(points: list[dict]) -> list[dict]:
    """The options no other option beats on both time and cost, fastest first."""
    front, best = [], float("inf")
    for p in sorted(points, key=lambda p: (p["hours"], p["usd"])):
        if p["usd"] < best:
            front.append(p)
            best = p["usd"]
    return front


def plan_report(record: dict) -> str:
    d = record["data"]
    points = []
    for o in d.get("options", []):
        if o["fits"] and o["compute"] and o["cost"]:
            c = min(o["cost"], key=lambda c: c["usd"])
            points.append(
                {
                    "label": f"{o['gpus']}x {o['gpu']}",
                    "hours": o["compute"]["wall_hours"],
                    "usd": c["usd"],
                    "provider": c["provider"],
                }
            )
    if not points:
        raise GpuwiseError(f"plan #{record['id']} has no priced option that fits: nothing to draw")
    front = pareto_front(points)
    title = f"{d['model']['name']} {d['task']}: cost against time, every priced option that fits"
    parts = [
        _img(plots.pareto(points, front, title), "Pareto front"),
        "<h2>Pareto front</h2>"
        + _table(
            ["option", "hours", "USD", "provider"], [[p["label"], p["hours"], p["usd"], p["provider"]] for p in front]
        ),
        f"<p class='note'>plan record #{record['id']}, {html.escape(record['created'])}; prices carry their "
        "sources in the record (gpuwise runs show).</p>",
    ]
    return _page(f"gpuwise plan: {d['model']['name']} {d['task']}", parts)


def bench_report(record: dict) -> str:
    import tempfile

    from gpuwise.bench.chart import draw

    d = record["data"]
    with tempfile.TemporaryDirectory() as tmp:
        png = draw(d, Path(tmp) / "bench.png").read_bytes()
    rows = []
    for dev, r in d["devices"].items():
        rows += [
            [dev, f"matmul {k}", m["tflops"] * 1e3, "GFLOP/s", m.get("fraction_of_peak")]
            for k, m in r["matmul"].items()
        ]
        rows.append([dev, "bandwidth triad", r["bandwidth"]["triad_gbs"], "GB/s", r["bandwidth"]["fraction_of_peak"]])
        rows += [
            [dev, f"{k} step", w["samples_per_s"], "samples/s", w.get("fraction_of_peak")]
            for k, w in r["workloads"].items()
        ]
    parts = [_img(png, "bench bars"), _table(["device", "test", "achieved", "unit", "fraction of peak"], rows)]
    if d.get("projections"):
        parts.append("<p class='note'>Hatched bars are projections from the catalog, not measurements.</p>")
    return _page(f"gpuwise bench #{record['id']} ({d['size']})", parts)
