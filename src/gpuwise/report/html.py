"""Self-contained HTML reports (PNG plots inlined as data URIs): a run, a plan sweep, a bench.

The pages are jinja2 templates with autoescape on: every string from a run's files or the record (a run
directory, a metric name, a price source) is escaped where it lands, never by hand."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from jinja2 import DictLoader, Environment
from pydantic import ValidationError

from gpuwise.bench.chart import draw
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import MAX_FILE_BYTES, MAX_METRICS_BYTES, read_run_file
from gpuwise.hardware.reference import GiB
from gpuwise.report import plots
from gpuwise.results import BenchResult, PlanResult, TrainSummary, problem

TEMPLATES = {
    "page.html": """<!doctype html>
<html><head><meta charset='utf-8'><title>{{ title }}</title>
<style>body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:right}
td:first-child,th:first-child{text-align:left}img{max-width:100%}.note{color:#666;font-size:90%}</style></head>
<body><h1>{{ title }}</h1>
{% block body %}{% endblock %}
</body></html>
""",
    "parts.html": """{% macro table(header, rows) -%}
<table><tr>{% for h in header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in rows %}<tr>{% for c in row %}<td>{{ c | cell }}</td>{% endfor %}</tr>
{% endfor %}</table>
{%- endmacro %}
{% macro img(figure) -%}
<img alt="{{ figure.alt }}" src="data:image/png;base64,{{ figure.png | b64 }}">
{%- endmacro %}
""",
    "run.html": """{% extends "page.html" %}{% from "parts.html" import table, img %}
{% block body %}
<p>{{ s.device }}, {{ s.precision }}, {{ s.steps }} steps ({{ "%.1f" | format(s.epochs) }} epochs),
global batch {{ s.global_batch }} = micro-batch {{ s.micro_batch }} x {{ s.accumulation }};
run directory <code>{{ s.run_dir }}</code></p>
<h2>Quality on held-out data</h2>
{{ table(["metric", "this run", s.baseline.name or "baseline", "published"], quality) }}
{% if s.published %}<p class='note'>published: {{ s.published.get("source", "") }}</p>
{% endif %}
{% if training %}<h2>Training</h2>
{% for figure in training %}{{ img(figure) }}
{% endfor %}{% endif %}
{% for figure in evals %}{{ img(figure) }}
{% endfor %}
<h2>Plan against actual</h2>
{{ img(plan_figure) }}
<p class='note'>plan: {{ s.plan.method }}; efficiency {{ s.plan.efficiency_origin }}. actual memory:
{{ s.actual.method }}</p>
{% if s.projection %}<h2>The same run on catalog GPUs (projection)</h2>
{{ table(["GPU", "precision", "sustained TFLOPS", "seconds", "USD", "price basis"], projection) }}
<p class='note'>{{ s.projection[0].basis }}</p>
{% endif %}
{% endblock %}
""",
    "plan.html": """{% extends "page.html" %}{% from "parts.html" import table, img %}
{% block body %}
{{ img(figure) }}
<h2>Pareto front</h2>
{{ table(["option", "hours", "USD", "provider"], front) }}
<p class='note'>plan record #{{ record.id }}, {{ record.created }}; prices carry their sources in the record
(gpuwise runs show).</p>
{% endblock %}
""",
    "bench.html": """{% extends "page.html" %}{% from "parts.html" import table, img %}
{% block body %}
{{ img(figure) }}
{{ table(["device", "test", "achieved", "unit", "fraction of peak"], rows) }}
{% if projected %}<p class='note'>Hatched bars are projections from the catalog, not measurements.</p>
{% endif %}
{% endblock %}
""",
}


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


_env = Environment(loader=DictLoader(TEMPLATES), autoescape=True, trim_blocks=True, lstrip_blocks=True)
_env.filters["cell"] = _fmt
_env.filters["b64"] = _b64


def _page(template: str, title: str, **values: Any) -> str:
    return _env.get_template(template).render(title=title, **values)


def _figure(png: bytes, alt: str) -> dict[str, Any]:
    return {"png": png, "alt": alt}


def _read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """summary.json and metrics.jsonl of a finished run, or one line saying which is missing or damaged."""
    texts = {}
    for name, limit in (("summary.json", MAX_FILE_BYTES), ("metrics.jsonl", MAX_METRICS_BYTES)):
        try:
            found = (run_dir / name).exists()
        except OSError as e:  # a name too long
            raise GpuwiseError(f"{run_dir}: {e.strerror}") from None
        if not found:
            raise GpuwiseError(f"{run_dir}: not a finished gpuwise run ({name} is missing)")
        texts[name] = read_run_file(run_dir / name, "run file", f"the {name} gpuwise train writes", limit)
    summary = parse_object(str(run_dir / "summary.json"), texts["summary.json"])
    return summary, _metric_rows(run_dir, texts["metrics.jsonl"])


def _metric_rows(run_dir: Path, text: str) -> list[dict[str, Any]]:
    """metrics.jsonl's lines as objects."""
    lines = text.splitlines()
    return [parse_object(f"{run_dir / 'metrics.jsonl'}:{n}", line) for n, line in enumerate(lines, 1) if line.strip()]


def parse_object(where: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise GpuwiseError(f"{where}: not a JSON object as gpuwise train writes it (truncated or edited?)")
    return value


# What a page builder raises when the JSON it reads parses but is not what gpuwise wrote (a field missing,
# a string where a number was): the files and the record are untrusted input, hand-edited or damaged.
# pydantic's ValidationError is a ValueError.
DAMAGED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def damaged(e: Exception) -> str:
    """What was wrong, as few words: the missing field where there is one."""
    if isinstance(e, ValidationError):
        return problem(e)
    return f"no '{e.args[0]}'" if isinstance(e, KeyError) else f"a value of the wrong kind: {first_line(e)}"


def run_figures(run_dir: Path) -> dict[str, Any]:
    """What a run's page draws: its summary and its metrics, line by line; `report RUN --json` prints it."""
    summary, rows = _read_run(run_dir)
    try:
        TrainSummary.load(summary)
    except DAMAGED as e:
        raise GpuwiseError(f"{run_dir}: not what gpuwise train writes ({damaged(e)})") from None
    return {"summary": summary, "metrics": rows}


def run_report(run_dir: Path) -> str:
    summary, rows = _read_run(run_dir)
    try:
        return _run_page(TrainSummary.load(summary), rows)
    except DAMAGED as e:
        raise GpuwiseError(f"{run_dir}: not what gpuwise train writes ({damaged(e)})") from None


def _run_page(s: TrainSummary, rows: list[dict[str, Any]]) -> str:
    train = [r for r in rows if "loss" in r]
    ev, base, published = s.eval, s.baseline, s.published
    keys = [k for k, v in ev.items() if isinstance(v, int | float) and k not in ("n", "users", "threshold")]
    quality = [[k, ev[k], base.metrics.get(k), published.get(k)] for k in keys]
    training = []
    if train:
        steps = [r["step"] for r in train]
        loss = plots.loss_curve(
            steps,
            [r["loss"] for r in train],
            [r["lr"] for r in train if "lr" in r],
            f"{s.workload}: loss and learning rate",
        )
        speed = plots.series(
            steps,
            [r["samples_per_s"] for r in train],
            "samples / s",
            "throughput per step (the first pays for warm-up)",
        )
        training = [_figure(loss, "loss curve"), _figure(speed, "throughput")]
    evals = []
    for key in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if len(pts) > 1:
            png = plots.series([p[0] for p in pts], [p[1] for p in pts], key[5:], f"held-out {key[5:]} during training")
            evals.append(_figure(png, key))
    plan, actual = s.plan, s.actual
    gib = GiB
    versus = plots.plan_vs_actual(
        [
            (
                "peak memory",
                plan.peak_bytes and plan.peak_bytes / gib,
                actual.peak_bytes and actual.peak_bytes / gib,
                "GiB",
            ),
            ("step time", plan.step_time_s, actual.step_time_s, "seconds"),
        ]
    )
    projection = [
        [p.gpu, p.precision, p.sustained_tflops, p.seconds, p.usd, f"{p.provider or '-'} {p.as_of or ''}"]
        for p in s.projection
    ]
    return _page(
        "run.html",
        f"gpuwise run: {s.workload}",
        s=s,
        quality=quality,
        training=training,
        evals=evals,
        plan_figure=_figure(versus, "plan vs actual"),
        projection=projection,
    )


def pareto_front(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The options no other option beats on both time and cost, fastest first."""
    front, best = [], float("inf")
    for p in sorted(points, key=lambda p: (p["hours"], p["usd"])):
        if p["usd"] < best:
            front.append(p)
            best = p["usd"]
    return front


def plan_figures(record: dict[str, Any]) -> dict[str, Any]:
    """What a plan's page draws: every priced option that fits (its hours and cheapest dollars) and the Pareto
    front of them; `report --plan ID --json` prints it."""
    if record["data"].get("traced"):  # one step on fake tensors: no job to price
        raise GpuwiseError(f"plan #{record['id']} has no priced option that fits: nothing to draw")
    d = PlanResult.load(record["data"])
    points = []
    for o in d.options:
        if o.fits and o.compute and o.cost:
            c = min(o.cost, key=lambda c: c.usd)
            points.append(
                {"label": f"{o.gpus}x {o.gpu}", "hours": o.compute.wall_hours, "usd": c.usd, "provider": c.provider}
            )
    if not points:
        raise GpuwiseError(f"plan #{record['id']} has no priced option that fits: nothing to draw")
    return {"model": d.model.name, "task": d.task, "points": points, "front": pareto_front(points)}


def plan_report(record: dict[str, Any]) -> str:
    f = plan_figures(record)
    title = f"{f['model']} {f['task']}: cost against time, every priced option that fits"
    return _page(
        "plan.html",
        f"gpuwise plan: {f['model']} {f['task']}",
        figure=_figure(plots.pareto(f["points"], f["front"], title), "Pareto front"),
        front=[[p["label"], p["hours"], p["usd"], p["provider"]] for p in f["front"]],
        record=record,
    )


def bench_rows(record: dict[str, Any]) -> list[list[Any]]:
    """A bench's figures as its page lists them: [device, test, achieved, unit, share of peak]."""
    d = BenchResult.load(record["data"])
    rows: list[list[Any]] = []
    for dev, r in d.devices.items():
        rows += [[dev, f"matmul {k}", m.tflops * 1e3, "GFLOP/s", m.fraction_of_peak] for k, m in r.matmul.items()]
        rows.append([dev, "bandwidth triad", r.bandwidth.triad_gbs, "GB/s", r.bandwidth.fraction_of_peak])
        rows += [[dev, f"{k} step", w.samples_per_s, "samples/s", w.fraction_of_peak] for k, w in r.workloads.items()]
    return rows


def bench_report(record: dict[str, Any]) -> str:
    import tempfile

    d = BenchResult.load(record["data"])
    with tempfile.TemporaryDirectory() as tmp:
        png = draw(d.dump(), Path(tmp) / "bench.png").read_bytes()
    return _page(
        "bench.html",
        f"gpuwise bench #{record['id']} ({d.size})",
        figure=_figure(png, "bench bars"),
        rows=bench_rows(record),
        projected=bool(d.projections),
    )
