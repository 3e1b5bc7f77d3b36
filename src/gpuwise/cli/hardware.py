"""`gpuwise hardware` (the sourced catalog) and `gpuwise devices` (what is here)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuwise.cli.options import CatalogOpt, JsonOpt, console, emit, load_catalog


def hardware(
    slug: Annotated[str | None, typer.Argument(help="Show one accelerator with every source, e.g. h100-sxm.")] = None,
    catalog: CatalogOpt = None,
    as_json: JsonOpt = False,
):
    """The accelerator catalog: memory, bandwidth, dense peaks, power, prices, each with source and date."""
    from dataclasses import asdict

    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.views import render_accelerator, render_hardware

    cat = load_catalog(catalog)
    if as_json:
        accs = [cat.get(slug)] if slug is not None else list(cat.accelerators.values())
        emit(
            {
                "accelerators": [asdict(a) for a in accs],
                "cloud_prices": [asdict(p) for p in cat.cloud if any(p.slug == a.slug for a in accs)],
                "purchase_prices": [asdict(p) for p in cat.purchase if any(p.slug == a.slug for a in accs)],
            }
        )
    elif slug is not None:
        render_accelerator(console, cat, slug)
    else:
        render_hardware(console, cat)


def devices(catalog: CatalogOpt = None, as_json: JsonOpt = False):
    """What is here: CPU, CUDA GPUs, MPS, their peaks, and what `gpuwise train` would pick.

    The CPU's FP32 peak is derived as cores x FLOP/cycle (from its ISA) x clock, and printed so.
    """
    # here, not at the top: `gpuwise --help` and the other commands start without it
    from gpuwise.hardware.devices import detect

    dev = detect(load_catalog(catalog))
    if as_json:
        emit(dev.as_dict())
    else:
        # here, not at the top: `gpuwise --help` and the other commands start without it
        from gpuwise.views import render_devices

        render_devices(console, dev)
