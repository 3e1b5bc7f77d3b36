"""The bench bars as a PNG: one panel per unit, a bar per device, projections hatched and labelled."""

from __future__ import annotations

from pathlib import Path


def draw(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = dict(result["devices"])
    columns |= {f"{slug} (projected)": p for slug, p in result.get("projections", {}).items()}
    panels = [
        ("matmul", "TFLOPS", lambda r: {k: v["tflops"] for k, v in r["matmul"].items()}),
        ("memory bandwidth (triad)", "GB/s", lambda r: {"triad": r["bandwidth"]["triad_gbs"]}),
        ("training step", "samples/s", lambda r: {k: v["samples_per_s"] for k, v in r["workloads"].items()}),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, unit, pick) in zip(axes, panels, strict=True):
        groups = sorted({g for r in columns.values() for g in pick(r)})
        width = 0.8 / max(1, len(columns))
        for n, (name, r) in enumerate(columns.items()):
            values = pick(r)
            xs = [i + n * width for i, g in enumerate(groups) if g in values]
            ys = [values[g] for g in groups if g in values]
            projected = "projected" in name
            ax.bar(
                xs,
                ys,
                width,
                label=name,
                color=colours[n % len(colours)],
                hatch="//" if projected else None,
                alpha=0.55 if projected else 1.0,
                edgecolor="black",
                linewidth=0.4,
            )
        ax.set_xticks([i + width * (len(columns) - 1) / 2 for i in range(len(groups))], groups)
        ax.set_yscale("log")
        ax.set_ylabel(f"{unit} (log scale)")
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"gpuwise bench ({result['size']}): timed on this machine; hatched bars are catalog projections")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
