"""Hosted LLM APIs' prices per million tokens, dated and sourced (data/hosted_prices.csv): what a served model
is weighed against. Rows are keyed by the catalog preset whose architecture the API serves (Llama 3.3 70B
under llama-3.1-70b: the same dimensions), or "closed" for the closed models users compare against."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True)
class HostedPrice:
    model: str
    provider: str
    api_model: str
    usd_in: float  # per 1 M input tokens
    usd_out: float  # per 1 M output tokens
    as_of: str
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


@cache
def _rows() -> tuple[HostedPrice, ...]:
    text = resources.files("gpuwise.plan").joinpath("data", "hosted_prices.csv").read_text(encoding="utf-8")
    return tuple(
        HostedPrice(
            r["model"],
            r["provider"],
            r["api_model"],
            float(r["usd_in_per_m"]),
            float(r["usd_out_per_m"]),
            r["as_of"],
            r["source"],
        )
        for r in csv.DictReader(text.splitlines())
    )


def hosted_prices(model: str) -> list[HostedPrice]:
    """The APIs that serve `model` (a preset's name), or the closed models for "closed"."""
    return [p for p in _rows() if p.model == model.lower()]
