"""The figures of a report, as PNG bytes: readable axes, units and titles on every one."""

from __future__ import annotations

import io


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    _plt().close(fig)
    return buf.getvalue()


def loss_curve(steps: list[int], losses: list[float], lrs: list[float], title: str) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, losses, lw=1, label="training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if lrs:
        twin = ax.twinx()
        twin.plot(steps, lrs, color="tab:orange", lw=1, alpha=0.7, label="learning rate")
        twin.set_ylabel("learning rate", color="tab:orange")
    return _png(fig)


def series(steps: list[int], values: list[float], ylabel: str, title: str) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(steps, values, lw=1, marker="o" if len(steps) < 30 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _png(fig)


def plan_vs_actual(rows: list[tuple[str, float | None, float | None, str]]) -> bytes:
    """rows: (quantity, plan, actual, unit): one panel each, two bars."""
    plt = _plt()
    rows = [r for r in rows if r[1] is not None and r[2] is not None]
    fig, axes = plt.subplots(1, max(1, len(rows)), figsize=(4 * max(1, len(rows)), 3.5))
    axes = axes if len(rows) > 1 else [axes]
    for ax, (name, plan, actual, unit) in zip(axes, rows, strict=False):
        assert plan is not None and actual is not None  # the filter above; lost on the tuple's type
        ax.bar(["plan", "actual"], [plan, actual], color=["tab:gray", "tab:blue"])
        ax.set_ylabel(unit)
        ax.set_title(f"{name}: error {(plan - actual) / actual:+.0%}")
        ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def pareto(points: list[dict], front: list[dict], title: str) -> bytes:
    """Cost against time, one point per option that fits; the Pareto front joined and labelled."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.scatter([p["hours"] for p in points], [p["usd"] for p in points], color="tab:gray", label="option that fits")
    for p in points:
        ax.annotate(p["label"], (p["hours"], p["usd"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot(
        [p["hours"] for p in front],
        [p["usd"] for p in front],
        color="tab:red",
        marker="o",
        label="Pareto front (no option is both cheaper and faster)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    for axis in (ax.xaxis, ax.yaxis):  # 0.5 and 20, not 5x10^-1 and 2x10^1
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(f"{v:g}")[0] in "25" else ""))
    ax.set_xlabel("wall-clock time (hours, log scale)")
    ax.set_ylabel("cost (USD, cheapest provider, log scale)")
    ax.set_title(title)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)
