"""`gpuwise serve --engine vllm`: vLLM's CPU build, in an environment of its own (tests/engines/vllm_venv.sh),
behind gpuwise's OpenAI API. The OpenAI surface over both engines is tests/test_llm_api.py's, parametrized;
here what only vLLM needs: the CLI that starts, supervises and stops it, greedy agreement with gpuwise's engine
on the real SmolLM2, two product-lm LoRA runs, a vLLM that dies, and a missing or failing one."""

import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serving import VLLM, Server, killed_is_one_line, serve_cli, stops_with_it, tiny_chat_model, vllm_python

from gpuwise.cli import main

ROOT = Path(__file__).resolve().parents[1]
BASE = "smollm2-135m-instruct"
PROMPTS = ["What is a GPU?", "Write a haiku about coffee.", "Name three uses of a recommender system.",
           "How should I store green tea?"]
# Greedy tokens that must agree. Both engines run the same fp32 weights, but with other kernels (vLLM's CPU
# attention and GEMMs; gpuwise's fused decoder over oneDNN), so sums are taken in another order and differ in
# the last bits. A greedy step whose two best logits lie that close would go another way and the texts part
# from there. Over these prompts the texts agreed for all of 128 tokens (docs/serving.md); 64 leaves a margin.
AGREE_TOKENS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def oa_sync(c: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.slow
def test_the_cli_serves_smollm2_through_vllm_as_gpuwise_does_and_stops_it(tmp_path):
    """From the CLI: the plan line names the engine and why, and vLLM's knobs; greedy chats agree with gpuwise's
    engine for AGREE_TOKENS tokens; SIGTERM stops gpuwise and the vLLM under it."""
    args = [BASE, "--engine", "vllm", "--vllm-python", vllm_python(), "--dtype", "fp32", "--max-seqs", "4",
            "--max-tokens", str(AGREE_TOKENS)]
    proc, port, printed = serve_cli(args, tmp_path / "serve.log", 600)
    try:
        assert "engine: vllm (--engine vllm; vLLM 0.32.0 at" in printed, printed
        for knob in ("tensor_parallel_size 1", "max_model_len 8,192", "(VLLM_CPU_KVCACHE_SPACE)", "max_num_seqs 4",
                     "dtype float32", "prefix caching on", "the same server by hand: VLLM_CPU_KVCACHE_SPACE="):
            assert knob in printed, (knob, printed)
        vllm_pid = int(re.search(r"pid (\d+), loopback port", printed).group(1))

        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        ask = {"max_tokens": AGREE_TOKENS, "temperature": 0}
        through_vllm = [oa.chat.completions.create(model=BASE, messages=[{"role": "user", "content": q}], **ask)
                        for q in PROMPTS]
        with Server(BASE, dtype="fp32", limits={"max_tokens": AGREE_TOKENS}) as c:
            own = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)
            through_gpuwise = [own.chat.completions.create(model=BASE, messages=[{"role": "user", "content": q}],
                                                           **ask) for q in PROMPTS]
        for v, g in zip(through_vllm, through_gpuwise, strict=True):
            assert v.choices[0].message.content == g.choices[0].message.content
            assert v.usage.completion_tokens == g.usage.completion_tokens  # the end-of-text token is not counted
            assert v.choices[0].finish_reason == g.choices[0].finish_reason

        stops_with_it(proc, vllm_pid, "vLLM")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A full fine-tune as the base and two LoRA runs over it (seeds 1 and 2, a high rate: their greedy answers
    differ), as tests/test_llm_api.py trains them."""
    from train_data import reviews_jsonl

    tmp = tmp_path_factory.mktemp("lora")
    data = reviews_jsonl(tmp / "r.jsonl")
    small = f"train product-lm --data {data} --block-size 32 --batch-size 4 --json"
    assert main(f"{small} --base scratch --method full --max-steps 1 --run-dir {tmp / 'base'}".split()) == 0
    for name, seed in (("a", 1), ("b", 2)):
        cmd = f"{small} --base {tmp / 'base' / 'model'} --method lora --lr 0.05 --max-steps 3 --seed {seed}"
        assert main(f"{cmd} --run-dir {tmp / name}".split()) == 0
    return [(n, str(tmp / n)) for n in ("a", "b", "base")]


@pytest.mark.slow
def test_two_lora_runs_answer_through_vllm_as_on_gpuwise_and_a_dead_vllm_is_one_line(lora_runs):
    """Two product-lm LoRA runs and their base in one vLLM (its LoRA modules; the base through a zero adapter,
    so that it is not given an adapter's output in a mixed batch) answer as on gpuwise's engine, alone and all
    at once. Then vLLM is killed: /health and the next request say so in one line, nothing hangs."""
    import asyncio

    ask = {"max_tokens": 12, "temperature": 0}
    prompts = ["This coffee", "My dog likes"]

    def answers(engine) -> dict:
        """{(model, prompt): (text, tokens)}, asked one at a time and then all at once. A run this small often
        generates bytes that are not UTF-8: gpuwise's detokenizer shows each as U+FFFD, vLLM's drops them, so
        the texts are compared without U+FFFD and the token counts beside them."""
        keys = [(n, q) for n, _ in lora_runs for q in prompts]
        with Server(lora_runs, engine=engine, dtype="fp32") as c:
            oa = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)

            def seen(r) -> tuple[str, int]:
                return r.choices[0].text.replace("\ufffd", ""), r.usage.completion_tokens

            async def all_at_once():
                return [seen(r) for r in await asyncio.gather(
                    *(oa.completions.create(model=n, prompt=q, **ask) for n, q in keys))]

            alone = {(n, q): seen(oa_sync(c).completions.create(model=n, prompt=q, **ask)) for n, q in keys}
            assert dict(zip(keys, asyncio.run(all_at_once()), strict=True)) == alone
            return alone

    ours = answers(None)
    assert len({tuple(ours[n, q] for q in prompts) for n, _ in lora_runs}) == 3  # each model its own answers
    vllm = VLLM(lora_runs)
    try:
        assert "LoRA: max_lora_rank 16, 3 module(s)" in vllm.backends[0][0].plan()  # product-lm: rank 16
        assert answers(vllm) == ours

        killed_is_one_line(vllm, lora_runs, "vLLM")
    finally:
        vllm.close()


def one_line_error(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(["serve", *args, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("  vllm | ")]  # vLLM's own log, above it
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_vllm_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("GPUWISE_VLLM_PYTHON", raising=False)
    assert "--vllm-python /nonexistent/python: no such executable" in one_line_error(
        capsys, [BASE, "--engine", "vllm", "--vllm-python", "/nonexistent/python"])
    assert f"--vllm-python {sys.executable}: that Python cannot import vllm" in one_line_error(
        capsys, [BASE, "--engine", "vllm", "--vllm-python", sys.executable])
    assert "--engine vllm: vLLM is not installed here" in one_line_error(capsys, [BASE, "--engine", "vllm"])
    assert "--engine tgi: choose auto, gpuwise, vllm" in one_line_error(capsys, [BASE, "--engine", "tgi"])


def test_a_vllm_that_fails_to_start_is_one_line_with_its_log_and_leaves_nothing(capsys, tmp_path):
    """A Python whose vLLM exits at start-up (a stand-in: a real one takes 16 s to fail), then the real vLLM
    given 2 s: both one line naming the log, the log's end shown above it, no process left behind."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nif [ "$1" = -c ]; then echo 0.32.0; exit 0; fi\n'
                    'echo "INFO starting"; echo "ValueError: no model here"; exit 1\n')
    fake.chmod(0o755)
    model = str(tiny_chat_model(tmp_path / "tiny-chat"))
    line = one_line_error(capsys, [model, "--engine", "vllm", "--vllm-python", str(fake), "--dtype", "fp32"])
    said = r"gpuwise: error: vLLM exited during start-up \(exit code 1\): ValueError: no model here"
    assert re.fullmatch(said + r" · its log: /\S+/vllm\.log", line), line
    assert "ValueError: no model here" in Path(line.rsplit("its log: ", 1)[1]).read_text()

    before = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True).stdout.split()
    line = one_line_error(capsys, [model, "--engine", "vllm", "--vllm-python", vllm_python(), "--vllm-timeout", "2",
                                   "--dtype", "fp32"])
    assert "vLLM did not answer within 2 s (--vllm-timeout)" in line, line
    after = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True).stdout.split()
    assert after == before, "the vLLM that missed its deadline was left running"


def test_plan_inference_names_the_engine_and_prints_a_vllm_command_vllm_takes(capsys):
    """`gpuwise plan --task inference`: the vLLM line for the recommended accelerator, parsed by vLLM's own
    argument parser and checks (tests/engines/check_vllm_args.py), and the knobs it set are the plan's."""
    import json

    cases = [
        (["--model", "llama-3.1-405b", "--gpu", "h100-sxm", "--gpus", "16", "--tp", "8", "--pp", "2"],
         "8 2 2048 {seqs} bfloat16 True ray 0.9"),
        (["--model", "llama-3.1-8b", "--precision", "fp8", "--seq", "4096"], "1 1 4096 {seqs} bfloat16 True None 0.9"),
    ]
    for flags, parsed in cases:
        capsys.readouterr()
        assert main(["plan", *flags, "--task", "inference", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        serving = plan["serving"]
        assert serving["engine"] == "vllm" and serving["command"].endswith(" ".join(serving["vllm"][-2:]))
        assert plan["max_batch"] >= 1 and serving["vllm"][serving["vllm"].index("--max-num-seqs") + 1] == str(
            plan["max_batch"])
        done = subprocess.run([vllm_python(), str(ROOT / "tests/engines/check_vllm_args.py"), *serving["vllm"]],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == parsed.format(seqs=plan["max_batch"])

    from gpuwise.plan.engines import serving_plan

    on_cpu = serving_plan(plan, "HuggingFaceTB/SmolLM2-135M-Instruct", "", 0, "cpu")
    assert on_cpu["engine"] == "gpuwise" and "ahead at 1, 8 and 32 streams" in on_cpu["why"]
    assert on_cpu["command"].startswith("VLLM_CPU_KVCACHE_SPACE=") and "--enforce-eager" in on_cpu["vllm"]
    assert "--gpu-memory-utilization" not in on_cpu["vllm"]


def test_the_vllm_plan_of_lora_runs_routes_each_model_and_vllm_takes_its_arguments(lora_runs, tmp_path):
    """What `gpuwise serve --engine vllm` would start, without starting it: the routes, the zero adapter the
    base goes through when it is served beside its adapters, the knobs, and vLLM's own parser taking them."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from gpuwise.errors import GpuwiseError
    from gpuwise.serve.engines.vllm import ZERO_ADAPTER, VLLMBackend
    from gpuwise.serve.models import model_groups
    from gpuwise.workloads.serving import Limits

    ((source, entries),) = model_groups(lora_runs).items()
    tok, config = AutoTokenizer.from_pretrained(source), AutoConfig.from_pretrained(source)
    limits = Limits(max_seqs=4, max_model_len=256, prefix_cache_tokens=0)
    together = VLLMBackend(source, tok, config, entries, limits, "bf16", "cpu")
    assert together.route == {"a": "a", "b": "b", None: ZERO_ADAPTER} and together.args.served_name == "base"
    modules = dict(together.args.lora_modules)
    assert list(modules) == ["a", "b", ZERO_ADAPTER]
    zero, a = (load_file(str(Path(modules[n]) / "adapter_model.safetensors")) for n in (ZERO_ADAPTER, "a"))
    assert zero.keys() == a.keys() and any("lora_B" in k for k in zero)
    assert all(not v.any() if "lora_B" in k else v.equal(a[k]) for k, v in zero.items())
    args = together.args.args()
    for flag, value in (("--max-model-len", "256"), ("--max-num-seqs", "4"), ("--max-lora-rank", "16"),
                        ("--dtype", "bfloat16"), ("--load-format", "safetensors"), ("--max-loras", "3")):
        assert args[args.index(flag) + 1] == value, flag
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    assert together.args.env()["VLLM_CPU_KVCACHE_SPACE"] == "1"  # 4 x 256 tokens: the least vLLM takes, 1 GiB
    done = subprocess.run([vllm_python(), str(ROOT / "tests/engines/check_vllm_args.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    alone = VLLMBackend(source, tok, config, entries[:1], limits, "bf16", "cpu")  # a LoRA run by itself
    assert alone.args.served_name == "gpuwise-base-model" and alone.route == {"a": "a", None: "gpuwise-base-model"}
    assert [n for n, _ in alone.args.lora_modules] == ["a"]

    planted = tmp_path / "planted"  # an adapter as pickle only: vLLM would unpickle it; refused first
    shutil.copytree(entries[0][1], planted)
    (planted / "adapter_model.safetensors").rename(planted / "adapter_model.bin")
    with pytest.raises(GpuwiseError, match="no adapter_model.safetensors"):
        VLLMBackend(source, tok, config, [("a", planted)], limits, "bf16", "cpu")


def test_serve_on_cuda_spreads_the_weights_over_the_fewest_gpus_that_hold_them():
    """`--engine vllm` on a CUDA machine: tensor_parallel_size from the weights and the GPUs' memory (no GPU here:
    the rule alone, on the figures of real machines)."""
    from gpuwise.plan.engines import tensor_parallel

    gib = 2**30
    assert tensor_parallel(16e9, 80 * gib, 8) == 1  # Llama-3.1-8B in bf16 on an H100 80GB
    assert tensor_parallel(141e9, 80 * gib, 8) == 4  # 70B in bf16: 141 GB over 4 x 57.6 GiB of room
    assert tensor_parallel(141e9, 141 * gib, 8) == 2  # the same on H200s
    assert tensor_parallel(810e9, 80 * gib, 8) == 8  # 405B: more than one node holds; all 8, vLLM says the rest
    assert tensor_parallel(141e9, 80 * gib, 3) == 2  # a power of two: the attention heads split evenly
