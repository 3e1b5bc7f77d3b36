"""The accelerator catalog: specs and prices, each row with its source and date.

Three CSV tables ship inside the package (``data/``). A user adds or overrides rows with files of
the same formats (``--catalog FILE`` or ``GPUWISE_CATALOG=FILE[:FILE...]``); the table a file
belongs to is told by its header. CSV rather than TOML because an error can then name the line,
and because people keep prices in spreadsheets.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest
from gpuwise.files import read_text_file

ENV_VAR = "GPUWISE_CATALOG"


@dataclass(frozen=True)
class Accelerator:
    slug: str
    name: str
    vendor: str
    kind: str  # gpu | tpu | cpu
    mem_gb: float  # vendors' "GB" of HBM/GDDR are GiB: an A100 80GB reports 81920 MiB
    mem_bw_gbs: float
    fp32_tflops: float | None
    tf32_tflops: float | None
    bf16_tflops: float | None  # dense tensor-core peak; None: no bf16 on this part
    fp16_tflops: float | None
    fp8_tflops: float | None
    int8_tops: float | None
    tdp_w: float | None
    interconnect: str
    nvlink_domain: int  # GPUs that reach each other at NVLink-class speed (1: PCIe only)
    max_per_node: int
    launch_year: int
    device_names: str  # regex alternatives matched against torch's device name
    source: str
    as_of: str
    origin: str = "built-in"
    line: int = 0

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gb * 2**30)

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak for a training/inference precision (fp32 means plain FP32 CUDA cores)."""
        return {
            "fp32": self.fp32_tflops,
            "tf32": self.tf32_tflops,
            "bf16": self.bf16_tflops,
            "fp16": self.fp16_tflops,
            "fp8": self.fp8_tflops,
        }[precision]


@dataclass(frozen=True)
class CloudPrice:
    slug: str
    provider: str
    usd_per_gpu_hour: float
    kind: str
    as_of: str
    source: str
    origin: str = "built-in"
    line: int = 0


@dataclass(frozen=True)
class PurchasePrice:
    slug: str
    item: str
    usd: float
    gpus: int
    as_of: str
    source: str
    origin: str = "built-in"
    line: int = 0

    @property
    def usd_per_gpu(self) -> float:
        return self.usd / self.gpus

    @property
    def what(self) -> str:
        """The price as it was quoted, and the share of one GPU where it is a server's: "$199,000 for NVIDIA
        DGX A100 ... / 8 GPUs = $24,875/GPU"; a per-GPU figure is never shown as if it were a list price."""
        quoted = f"${self.usd:,.0f} for {self.item}"
        return quoted + (f" / {self.gpus} GPUs = ${self.usd_per_gpu:,.0f}/GPU" if self.gpus > 1 else "")


# A price older than this is flagged where a recommendation rests on it: GPU prices move within a year.
STALE_DAYS = 365


def price_age(as_of: str, today: dt.date | None = None) -> tuple[str, bool]:
    """A price's date in words ("as of 2022-10, 4.2 years old") and whether it is undated or older than
    STALE_DAYS, from `today` (default: today)."""
    if as_of == "undated":
        return "undated", True
    try:
        parts = [int(x) for x in as_of.split("-")]
        when = dt.date(parts[0], parts[1] if len(parts) > 1 else 1, parts[2] if len(parts) > 2 else 1)
    except (ValueError, IndexError):
        return f"as of {as_of}", False
    days = ((today or dt.date.today()) - when).days
    if days <= STALE_DAYS:
        return f"as of {as_of}", False
    return f"as of {as_of}, {days / 365.25:.1f} years old", True


# Column -> (type, required). The header of a file picks its table.
_NUM, _OPT, _INT, _STR, _OSTR = "number", "optional number", "integer", "text", "optional text"
TABLES: dict[str, tuple[type, dict[str, str]]] = {
    "accelerators": (
        Accelerator,
        {
            "slug": _STR,
            "name": _STR,
            "vendor": _STR,
            "kind": _STR,
            "mem_gb": _NUM,
            "mem_bw_gbs": _NUM,
            "fp32_tflops": _OPT,
            "tf32_tflops": _OPT,
            "bf16_tflops": _OPT,
            "fp16_tflops": _OPT,
            "fp8_tflops": _OPT,
            "int8_tops": _OPT,
            "tdp_w": _OPT,
            "interconnect": _OSTR,
            "nvlink_domain": _INT,
            "max_per_node": _INT,
            "launch_year": _INT,
            "device_names": _OSTR,
            "source": _STR,
            "as_of": _STR,
        },
    ),
    "cloud_prices": (
        CloudPrice,
        {"slug": _STR, "provider": _STR, "usd_per_gpu_hour": _NUM, "kind": _OSTR, "as_of": _STR, "source": _STR},
    ),
    "purchase_prices": (
        PurchasePrice,
        {"slug": _STR, "item": _STR, "usd": _NUM, "gpus": _INT, "as_of": _STR, "source": _STR},
    ),
}
_KINDS = {"gpu", "tpu", "cpu"}
# Each number's plausible range, far beyond any real part or price, so that a unit slip (bytes/s typed as
# GB/s, a price in cents x 1e6) is refused at its line instead of planned; the lows of the figures the
# planner divides by (memory, bandwidth, peaks) keep its quotients finite. A peak of 0 means "none".
_PEAK = (0.001, 1e6)
_RANGE: dict[str, tuple[float, float]] = {
    "mem_gb": (0.001, 1e5),
    "mem_bw_gbs": (0.001, 1e6),
    "fp32_tflops": _PEAK,
    "tf32_tflops": _PEAK,
    "bf16_tflops": _PEAK,
    "fp16_tflops": _PEAK,
    "fp8_tflops": _PEAK,
    "int8_tops": _PEAK,
    "tdp_w": (0, 1e5),
    "nvlink_domain": (1, 1e6),
    "max_per_node": (1, 1e6),
    "launch_year": (1950, 2100),
    "usd_per_gpu_hour": (0, 1e4),
    "usd": (0, 1e10),
    "gpus": (1, 1e6),
}
_SLUG = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


def _convert(path: str, line: int, column: str, kind: str, raw: str | None):
    raw = (raw or "").strip()
    where = f"{path}:{line}: field '{column}'"
    if not raw:
        if kind.startswith("optional"):
            return None if kind == _OPT else ""
        raise GpuwiseError(f"{where}: is empty, a value is required")
    if kind in (_STR, _OSTR):
        if column == "device_names":  # matched against every GPU's name later: a broken one fails here, named
            try:
                re.compile(raw)
            except re.error as e:
                raise GpuwiseError(f"{where}: '{raw}' is not a regular expression ({e})") from None
        return raw
    try:
        value = int(raw) if kind == _INT else float(raw)
    except ValueError:
        raise GpuwiseError(f"{where}: '{raw}' is not {'an integer' if kind == _INT else 'a number'}") from None
    if kind != _INT and not math.isfinite(value):
        raise GpuwiseError(f"{where}: '{raw}' is not a finite number")
    if value < 0 or (kind == _INT and value == 0):
        raise GpuwiseError(f"{where}: '{raw}' must be positive")
    low, high = _RANGE.get(column, (0, math.inf))
    if not low <= value <= high and not (value == 0 and kind == _OPT):
        raise GpuwiseError(f"{where}: '{raw}' must be between {low:g} and {high:g}")
    return value


def read_table(path: str | Path, text: str | None = None, origin: str | None = None):
    """Parse one catalog CSV; returns (table name, rows). Errors name the line and the field."""
    path = str(path)
    if text is None:
        text = read_text_file(path, "catalog file", "a CSV")
    try:
        return _read_rows(path, csv.DictReader(text.splitlines()), origin)
    except csv.Error as e:  # a field over the csv module's 128 kB limit, say
        raise GpuwiseError(f"{path}: not a readable CSV ({e})") from None


def _read_rows(path: str, reader: csv.DictReader, origin: str | None):
    header = set(reader.fieldnames or [])
    table = next((t for t, (_, cols) in TABLES.items() if set(cols) <= header), None)
    if table is None:
        wanted = "; ".join(f"{t}: {','.join(cols)}" for t, (_, cols) in TABLES.items())
        raise GpuwiseError(f"{path}:1: header matches no catalog table (need the columns of one of: {wanted})")
    cls, columns = TABLES[table]
    rows = []
    for rec in reader:
        line = reader.line_num
        if None in rec:
            raise GpuwiseError(f"{path}:{line}: more fields than the header has columns")
        values = {c: _convert(path, line, c, k, rec.get(c)) for c, k in columns.items()}
        if not _SLUG.match(values["slug"]):
            raise GpuwiseError(
                f"{path}:{line}: field 'slug': '{values['slug']}' must be lower-case letters, digits, '-' or '.'"
            )
        if table == "accelerators" and values["kind"] not in _KINDS:
            raise GpuwiseError(f"{path}:{line}: field 'kind': '{values['kind']}' is not one of {sorted(_KINDS)}")
        rows.append(cls(**values, origin=origin or path, line=line))
    return table, rows


@dataclass
class Catalog:
    accelerators: dict[str, Accelerator] = field(default_factory=dict)
    cloud: list[CloudPrice] = field(default_factory=list)
    purchase: list[PurchasePrice] = field(default_factory=list)
    # (slug, "matmul.<dtype>") -> (fraction of dense peak, origin), from `gpuwise bench` runs on such a card
    calibration: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)

    def get(self, slug: str) -> Accelerator:
        if not slug.strip():
            raise GpuwiseError("an empty accelerator name: give a slug (see `gpuwise hardware`)")
        acc = self.accelerators.get(slug.lower())
        if acc is None:
            raise GpuwiseError(
                f"unknown accelerator '{slug}'{closest(slug, self.accelerators)}; see `gpuwise hardware`"
            )
        return acc

    def prices(self, slug: str) -> list[CloudPrice]:
        return sorted((p for p in self.cloud if p.slug == slug), key=lambda p: p.usd_per_gpu_hour)

    def purchase_price(self, slug: str) -> PurchasePrice | None:
        """The price an on-prem estimate uses: a user's own entry first, then a whole server (a card
        alone does not run), then the newest dated entry."""
        rows = [p for p in self.purchase if p.slug == slug]
        if not rows:
            return None
        return max(rows, key=lambda p: (p.origin != "built-in", p.gpus > 1, p.as_of != "undated", p.as_of))

    def add(self, table: str, rows: list) -> None:
        if table == "accelerators":
            for row in rows:
                self.accelerators[row.slug] = row
            return
        for row in rows:
            if row.slug not in self.accelerators:
                raise GpuwiseError(
                    f"{row.origin}:{row.line}: field 'slug': price for unknown accelerator '{row.slug}'"
                    f"{closest(row.slug, self.accelerators)} (add it to an accelerators file first)"
                )
        if table == "cloud_prices":
            keys = {(r.slug, r.provider.lower()) for r in rows}
            self.cloud = [p for p in self.cloud if (p.slug, p.provider.lower()) not in keys] + rows
        else:
            self.purchase += rows


def _builtin_text(name: str) -> str:
    return resources.files("gpuwise.hardware").joinpath("data", name).read_text(encoding="utf-8")


def load_catalog(extra: Sequence[str | Path] | None = None) -> Catalog:
    """Built-in tables, then the files of GPUWISE_CATALOG, then ``extra`` (later rows win)."""
    catalog = Catalog()
    for name in ("accelerators.csv", "cloud_prices.csv", "purchase_prices.csv"):
        catalog.add(*read_table(f"<built-in>/{name}", _builtin_text(name), origin="built-in"))
    files = [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p] + [str(p) for p in extra or []]
    # Accelerator files first, so a user's price file may name a user's own card.
    parsed = [read_table(f) for f in files]
    for table, rows in sorted(parsed, key=lambda tr: tr[0] != "accelerators"):
        catalog.add(table, rows)
    return catalog


def match_device(catalog: Catalog, device_name: str) -> Accelerator | None:
    """The catalog row for a name like torch.cuda.get_device_name() returns, or None."""
    best, best_len = None, 0
    for acc in catalog.accelerators.values():
        m = re.search(acc.device_names, device_name, re.IGNORECASE) if acc.device_names else None
        # The longest matched text wins when two patterns hit the same name.
        if m and len(m.group(0)) > best_len:
            best, best_len = acc, len(m.group(0))
    return best
