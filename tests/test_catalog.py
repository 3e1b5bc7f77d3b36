"""The hardware catalog: complete, sourced, and overridable by the user's own files."""

import re

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog, match_device

SLUGS = [
    "t4",
    "l4",
    "a10",
    "a10g",
    "l40s",
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h100-nvl",
    "h200",
    "b200",
    "rtx-3090",
    "rtx-4090",
    "rtx-5090",
    "rtx-a6000",
    "mi250x",
    "mi300x",
    "tpu-v4",
    "tpu-v5e",
    "tpu-v5p",
]


def test_every_required_slug_is_in_the_catalog(catalog):
    assert set(SLUGS) <= set(catalog.accelerators)


def test_every_figure_has_a_source_and_a_date(catalog):
    """Every price is dated (a year at least): an undated one cannot be said to be stale (issue #50)."""
    for acc in catalog.accelerators.values():
        assert acc.source and acc.as_of, acc.slug
    for price in catalog.cloud + catalog.purchase:
        assert price.source and re.fullmatch(r"\d{4}(-\d{2}(-\d{2})?)?", price.as_of), price


def test_catalog_matches_the_reference_rows(catalog):
    # Spot checks of hardware/data/accelerators.csv and cloud_prices.csv against their sources' figures.
    h100 = catalog.get("h100-sxm")
    assert (h100.mem_gb, h100.mem_bw_gbs, h100.bf16_tflops, h100.fp8_tflops, h100.tdp_w) == (80, 3350, 989, 1979, 700)
    assert catalog.get("t4").bf16_tflops is None  # Turing: no bf16
    assert [catalog.get(s).name for s in ("t4", "l4", "a10")] == ["NVIDIA T4", "NVIDIA L4", "NVIDIA A10"]
    assert {p.provider: p.usd_per_gpu_hour for p in catalog.prices("h100-sxm")}["Lambda"] == 3.99
    assert len(catalog.cloud) == 39 and len(catalog.purchase) == 11


def test_purchase_price_prefers_a_whole_server(catalog):
    p = catalog.purchase_price("h100-sxm")
    assert p.gpus == 8 and p.as_of == "2024-03"


def test_user_file_overrides_a_price_and_adds_a_card(tmp_path):
    cards = tmp_path / "cards.csv"
    cards.write_text(
        "slug,name,vendor,kind,mem_gb,mem_bw_gbs,fp32_tflops,tf32_tflops,bf16_tflops,fp16_tflops,fp8_tflops,"
        "int8_tops,tdp_w,interconnect,nvlink_domain,max_per_node,launch_year,device_names,source,as_of\n"
        "my-card,My Card,acme,gpu,96,2000,50,100,400,400,,,500,PCIe,1,4,2026,My Card,our lab,2026-11\n"
    )
    prices = tmp_path / "prices.csv"
    prices.write_text(
        "slug,provider,usd_per_gpu_hour,kind,as_of,source\n"
        "h100-sxm,Lambda,1.50,reserved,2026-11,our contract\n"
        "my-card,OurCloud,0.90,reserved,2026-11,our contract\n"
    )
    cat = load_catalog([prices, cards])  # order does not matter: cards load first
    assert cat.get("my-card").mem_gb == 96
    lambda_h100 = [p for p in cat.prices("h100-sxm") if p.provider == "Lambda"]
    assert [p.usd_per_gpu_hour for p in lambda_h100] == [1.50]
    assert cat.prices("my-card")[0].origin == str(prices)


def test_environment_variable_adds_files(tmp_path, monkeypatch):
    prices = tmp_path / "p.csv"
    prices.write_text("slug,provider,usd_per_gpu_hour,kind,as_of,source\nt4,Home,0.10,own,2026-11,us\n")
    monkeypatch.setenv("GPUWISE_CATALOG", str(prices))
    assert "Home" in {p.provider for p in load_catalog().prices("t4")}


@pytest.mark.parametrize(
    "body,expected",
    [
        (
            "slug,provider,usd_per_gpu_hour,kind,as_of,source\nt4,X,cheap,k,2026,s\n",
            ":2: field 'usd_per_gpu_hour': 'cheap' is not a number",
        ),
        (
            "slug,provider,usd_per_gpu_hour,kind,as_of,source\nt4,X,1,k,2026,s\nt4,Y,,k,2026,s\n",
            ":3: field 'usd_per_gpu_hour': is empty",
        ),
        (
            "slug,provider,usd_per_gpu_hour,kind,as_of,source\nh1000,X,1,k,2026,s\n",
            ":2: field 'slug': price for unknown accelerator 'h1000' (closest: ",
        ),
        (
            "slug,provider,usd_per_gpu_hour,kind,as_of,source\nt4,X,-1,k,2026,s\n",
            ":2: field 'usd_per_gpu_hour': '-1' must be positive",
        ),
        ("name,price\nfoo,1\n", ":1: header matches no catalog table"),
        (
            "slug,provider,usd_per_gpu_hour,kind,as_of,source\nt4,X,1,k,2026,s,extra\n",
            ":2: more fields than the header",
        ),
    ],
)
def test_malformed_file_names_line_and_field(tmp_path, body, expected):
    f = tmp_path / "bad.csv"
    f.write_text(body)
    with pytest.raises(GpuwiseError, match=None) as err:
        load_catalog([f])
    assert expected in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(GpuwiseError, match="cannot read catalog file"):
        load_catalog([tmp_path / "nope.csv"])


@pytest.mark.parametrize(
    "name,slug",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("Tesla T4", "t4"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA B200", "b200"),
        ("Some Unknown GPU", None),
    ],
)
def test_torch_device_names_match_catalog_rows(catalog, name, slug):
    acc = match_device(catalog, name)
    assert (acc.slug if acc else None) == slug


def test_a_price_says_what_it_is_and_its_share_of_one_gpu_is_shown_derived(catalog, capsys):
    """A server's price is shown as quoted, and a GPU's share of it as derived from it: "$199,000 for ... / 8
    GPUs = $24,875/GPU", never "$24,875" as if a GPU were sold at that; every purchase row says what kind of
    price it is (issue #50)."""
    import json

    from gpuwise.cli import main

    for p in catalog.purchase:
        assert re.search(r"launch (price|MSRP)|as reported|as estimated", p.item), p
    dgx = next(p for p in catalog.purchase if p.slug == "a100-40gb")
    said = "$199,000 for NVIDIA DGX A100 server (8x A100 40GB) at its launch price / 8 GPUs = $24,875/GPU"
    assert dgx.what == said
    assert main(["hardware", "a100-40gb"]) == 0
    assert said in " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "a100-40gb"]) == 0
    assert "$199,000 for NVIDIA DGX A100 server" in " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "a100-40gb", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["onprem"]
    assert (on["purchase_usd"], on["purchase_gpus"], on["purchase_usd_per_gpu"]) == (199000, 8, 24875)


def test_no_source_repeats_its_date(catalog):
    for price in catalog.cloud + catalog.purchase:
        assert f"({price.as_of})" not in price.source, price


def test_a_price_s_age_and_when_it_is_stale():
    from datetime import date

    from gpuwise.hardware.catalog import price_age

    today = date(2026, 12, 4)
    assert price_age("2022-10", today) == ("as of 2022-10, 4.2 years old", True)
    assert price_age("2026-09", today) == ("as of 2026-09", False)
    assert price_age("2025-11-20", today) == ("as of 2025-11-20, 1.0 years old", True)
    assert price_age("undated", today) == ("undated", True)


def test_a_recommendation_resting_on_an_old_purchase_price_says_so(capsys, tmp_path):
    import json

    from gpuwise.cli import main

    quote = tmp_path / "quote.csv"
    quote.write_text("slug,item,usd,gpus,as_of,source\nrtx-4090,one RTX 4090 card as quoted to us,1700,1,2021-03,"
                     "our reseller\n")  # fmt: skip
    argv = ["plan", "--model", "llama-3.1-8b", "--task", "qlora", "--gpu", "rtx-4090", "--json"]
    argv += ["--catalog", str(quote)]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["onprem"]["as_of"] == "2021-03"
    [said] = [w for w in res["warnings"] if w.startswith("the on-prem figure rests on a purchase price")]
    assert "as of 2021-03" in said and "years old" in said and "our reseller" in said
