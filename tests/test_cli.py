"""The CLI as a user meets it: JSON schema, human output, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from gpuwise.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_documented_schema(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--task", "qlora", "--json")
    assert code == 0
    res = json.loads(out)
    assert {
        "model",
        "task",
        "gpu",
        "gpus",
        "memory",
        "fits",
        "kv_cache_per_token",
        "trainable_params",
        "compute",
        "cost",
        "warnings",
        "options",
    } <= set(res)
    assert set(res["model"]) >= {"name", "params"}
    assert set(res["memory"]) == {"weights", "gradients", "optimizer", "activations", "kv_cache", "overhead", "total"}
    assert all(isinstance(v, int) for v in res["memory"].values())  # bytes
    assert {"flops", "efficiency", "gpu_hours", "wall_hours", "tokens_per_s"} <= set(res["compute"])
    assert all({"provider", "usd"} <= set(c) for c in res["cost"])
    assert len(res["options"]) >= 20 and res["options"][0]["cheapest"]
    assert res["fits"] and res["recommended"]
    assert sum(o["fastest"] for o in res["options"]) == 1


def test_sweep_is_sorted_by_cost_among_fitting_options(capsys):
    _, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--task", "lora", "--json")
    rows = json.loads(out)["options"]
    costs = [min(c["usd"] for c in r["cost"]) for r in rows if r["fits"] and r["cost"]]
    assert costs == sorted(costs)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # all fitting rows come first


def test_what_the_sweep_lists_out_of_price_order_is_marked_and_said(capsys):
    """At batch 32 an 8B model needs two of a 24 GB card: tensor parallel over PCIe, whose time is too optimistic
    to compete, so it is listed after the price order, and says so (issue #50)."""
    _, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--batch", "32", "--json")
    rows = [r for r in json.loads(out)["options"] if r["fits"]]
    kept = [r for r in rows if not r["demoted"]]
    assert rows[: len(kept)] == kept  # the price order first, the demoted after it
    costs = [min(c["usd"] for c in r["cost"]) for r in kept if r["cost"]]
    assert costs == sorted(costs) and all(r["cost"] for r in kept)
    [rtx4090] = [r for r in rows if r["gpu"] == "rtx-4090"]
    assert rtx4090["layout"]["tp"] == 2 and rtx4090["demoted"].startswith("tensor parallel over PCIe")
    assert min(c["usd"] for c in rtx4090["cost"]) < costs[-1]  # cheaper-looking, yet below
    _, text, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--batch", "32")
    flat = " ".join(text.split())
    assert "rtx-4090 ↓" in flat and "↓ listed after the price order: no price in the catalog; tensor parallel" in flat


def test_plan_with_one_gpu_picks_the_fewest_that_fit(capsys):
    _, out, _ = run(capsys, "plan", "--model", "llama-3.1-70b", "--task", "finetune", "--gpu", "h100-sxm", "--json")
    res = json.loads(out)
    assert res["fits"] and res["gpus"] > 1 and res["layout"]["zero"] == 3
    assert len(res["options"]) == 1


def test_human_output_names_the_recommendation_and_the_assumptions(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--task", "qlora")
    assert code == 0
    assert "Recommended:" in out and "★" in out and "Assumptions:" in out and "PaLM" in out


def test_hardware_lists_and_details(capsys):
    code, out, _ = run(capsys, "hardware", "--json")
    assert code == 0 and len(json.loads(out)["accelerators"]) >= 21
    code, out, _ = run(capsys, "hardware", "h100-sxm")
    assert code == 0 and "Lambda" in out and "spec source" in out


def test_devices_json(capsys):
    code, out, _ = run(capsys, "devices", "--json")
    dev = json.loads(out)
    assert code == 0 and dev["cpu"]["cores"] >= 1 and dev["cpu"]["fp32_peak_gflops"]
    assert dev["train_default"]["accelerator"] in ("cuda", "mps", "cpu")


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "--model", "llama-3.1-8x"], "unknown model 'llama-3.1-8x' (closest: llama-3.1-8b"),
        (["plan", "--model", "llama-3.1-8b", "--gpu", "h100"], "unknown accelerator 'h100' (closest:"),
        (
            ["plan", "--model", "llama-3.1-8b", "--task", "pretrain", "--lora-rank", "8"],
            "QLoRA is a fine-tuning method",
        ),
        (["plan", "--model", "llama-3.1-8b", "--tp", "3"], "--tp 3 must divide"),
        (["plan", "--model", "llama-3.1-8b", "--tp", "64"], "must divide"),
        (["plan", "--model", "llama-3.1-8b", "--gpus", "6", "--tp", "4"], "not a multiple of"),
        (["plan", "--model", "llama-3.1-8b", "--task", "lora", "--gen", "10"], "--gen"),
        (["plan", "--model", "llama-3.1-8b", "--optimizer", "sgd"], "applies to training"),
        (["plan", "--model", "llama-3.1-8b", "--provider", "Lambada"], "unknown provider 'Lambada' (closest: lambda"),
        (["plan", "--model", "llama-3.1-8b", "--efficiency", "2"], "--efficiency"),
        (["plan", "--model", "llama-3.1-8b", "--seq", "999999"], "longer than"),
        (["plan", "--model", "layers=2,hidden=64"], "lack heads"),
        (["plan", "--model", "llama-3.1-8b", "--modle", "x"], "No such option: --modle"),
        (["plan", "--model", "llama-3.1-8b", "--task", "train"], "'train' is not one of"),
        (["plan", "--model", "llama-3.1-8b", "--catalog", "/nonexistent.csv"], "cannot read catalog file"),
        (["hardware", "h1000"], "unknown accelerator 'h1000'"),
        (["plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "-5"], "--tokens must be at least 1"),
        (["plan", "--model", "llama-3.1-8b", "--pue", "0.5"], "--pue"),
        (["plan", "--model", "llama-3.1-8b", "--batch", "0"], "at least 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert out == ""


def test_bad_config_json_is_one_line(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",')
    code, _, err = run(capsys, "plan", "--model", str(bad))
    assert code == 2 and "not valid JSON" in err
    bad.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = run(capsys, "plan", "--model", str(bad))
    assert code == 2 and "not a UTF-8 text file" in err
    code, _, err = run(capsys, "hardware", "--catalog", str(bad))
    assert code == 2 and "not a UTF-8 text file" in err
    bad.write_text('{"model_type": "mamba"}')
    code, _, err = run(capsys, "plan", "--model", str(bad))
    assert code == 2 and "model_type 'mamba' is not supported" in err


def test_console_script_exit_code_and_no_torch_on_the_plan_path():
    # A real process: the exit code, and that planning never imports torch or numpy.
    code = (
        "import sys; from gpuwise.cli import main; rc = main(['plan', '--model', 'llama-2-7b', '--json']); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-m", "gpuwise", "plan", "--model", "nope"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("gpuwise: error: unknown model")
