"""A Hugging Face hub id wherever a model is named (issue #50, item 4): `plan` reads its config.json from the local
hub cache, or plans the preset of its base (an instruct or chat variant has its base's dimensions), or says in one
line, at once, that it downloads nothing; `train --base`, `launch` and `serve` say in one line, at once, that a
hub id the cache lacks cannot be fetched where the hub cannot be reached, instead of retrying for 50 s."""

from __future__ import annotations

import json
import time

import pytest
from huggingface_hub import constants

from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.workloads.pretrained import hub_reachable


def plan(capsys, model: str) -> tuple[int, dict | str]:
    code = main(["plan", "--model", model, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else err


@pytest.mark.parametrize(
    "repo,preset",
    [("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
     ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"), ("meta-llama/Llama-3.1-8B", "llama-3.1-8b")],
)  # fmt: skip
def test_a_hub_id_of_a_preset_s_model_or_its_variant_plans_as_that_preset(capsys, repo, preset):
    code, res = plan(capsys, repo)
    assert code == 0 and isinstance(res, dict) and res["model"]["name"] == preset


def fake_cache(root, repo: str, config: dict) -> None:
    """The layout huggingface_hub keeps: models--OWNER--NAME/{refs/main, snapshots/COMMIT/config.json}."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc123")
    (folder / "snapshots" / "abc123").mkdir(parents=True)
    (folder / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))


def test_a_hub_id_in_the_local_cache_is_planned_from_its_config(capsys, tmp_path, monkeypatch):
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": 4096}  # fmt: skip
    fake_cache(tmp_path, "acme/tiny-chat", config)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    code, res = plan(capsys, "acme/tiny-chat")
    assert code == 0 and isinstance(res, dict) and res["model"]["name"] == "acme/tiny-chat"
    assert 2e6 < res["model"]["params"] < 4e6


def test_a_hub_id_neither_cached_nor_a_preset_is_one_line_at_once(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    t = time.perf_counter()
    code, err = plan(capsys, "acme/secret-model")
    assert code == 2 and isinstance(err, str) and err.count("\n") == 1, err
    assert "no file here, and as a Hugging Face hub id" in err and "downloads nothing" in err
    assert "hf download acme/secret-model config.json" in err
    assert time.perf_counter() - t < 5  # no network tried


def test_a_base_the_cache_lacks_where_the_hub_cannot_be_reached_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(GpuwiseError, match=r"--base acme/x: not in the local hub cache .* cannot be reached"):
        hub_reachable("acme/x")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(GpuwiseError, match="HF_HUB_OFFLINE is set"):
        hub_reachable("acme/x")
    # through `gpuwise train --base`, before anything loads
    t = time.perf_counter()
    assert main(["train", "product-lm", "--base", "acme/x", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--base acme/x: not in the local hub cache" in err, err
    assert time.perf_counter() - t < 30 and not (tmp_path / "r" / "summary.json").exists()
    fake_cache(tmp_path, "acme/x", {"model_type": "llama"})
    hub_reachable("acme/x")  # cached: nothing to reach
