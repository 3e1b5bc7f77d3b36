"""`gpuwise serve --engine llama.cpp`: llama.cpp's llama-server (built by tests/engines/llamacpp_build.sh, as
`make llama.cpp` builds it) behind gpuwise's OpenAI API. The OpenAI surface over every engine is
tests/test_llm_api.py's, parametrized; here what only llama.cpp needs: the CLI serving the named base's GGUF as
it ships and stopping llama-server with it, LoRA runs as GGUF adapters applied per request, a llama-server that
dies, a missing one, and the `auto` rule."""

import re
from pathlib import Path

import openai
import pytest
from serving import Engine, Server, killed_is_one_line, llama_server, serve_cli, stops_with_it
from test_vllm_engine import BASE, PROMPTS, lora_runs, oa_sync, one_line_error

from gpuwise.plan.engines import auto_engine

__all__ = ["lora_runs"]  # the fixture, shared with test_vllm_engine.py


@pytest.mark.slow
def test_the_cli_serves_the_named_base_as_it_ships_and_stops_llama_server(tmp_path):
    """From the CLI: the Q4_1 GGUF served as it ships, the plan line naming the engine, why, and llama.cpp's
    knobs from gpuwise's plan; chats answer; SIGTERM stops gpuwise and the llama-server under it."""
    args = [BASE, "--engine", "llama.cpp", "--llama-server", str(llama_server()), "--max-seqs", "4", "--max-tokens",
            "32", "--max-model-len", "1024"]
    proc, port, printed = serve_cli(args, tmp_path / "serve.log", 120)
    try:
        assert "engine: llama.cpp (--engine llama.cpp; llama-server (version:" in printed, printed
        for knob in ("plan (q4_1): llama.cpp: 4 slots sharing a KV cache of 4,096 tokens (f16)",
                     "SmolLM2-135M-Instruct.Q4_1.gguf as it ships", "the same server by hand: ", "--kv-unified"):
            assert knob in printed, (knob, printed)
        pid = int(re.search(r"pid (\d+), loopback port", printed).group(1))
        # gpuwise's own OMP_WAIT_POLICY stays in its process: llama-server's workers keep their default
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"OMP_WAIT_POLICY=", b"GPUWISE_OWN_ONLY="))], environ
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for q in PROMPTS[:2]:
            r = oa.chat.completions.create(model=BASE, messages=[{"role": "user", "content": q}], max_tokens=32,
                                           temperature=0)
            assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
            assert len(r.choices[0].message.content.split()) >= 3  # words, from the real model
        stops_with_it(proc, pid, "llama-server")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_lora_runs_are_gguf_adapters_applied_per_request_and_a_dead_llama_server_is_one_line(lora_runs):
    """Two product-lm LoRA runs and their base in one llama-server: each model its own answers, the same
    alone and all at once. Then llama-server is killed: /health and the next request say so in one line."""
    import asyncio

    ask = {"max_tokens": 12, "temperature": 0}
    keys = [(n, q) for n, _ in lora_runs for q in ("This coffee", "My dog likes")]
    engine = Engine("llama.cpp", lora_runs)
    try:
        assert "2 LoRA adapter(s), applied per request" in engine.backends[0][0].plan()
        with Server(lora_runs, engine=engine) as c:
            oa = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)

            def seen(r) -> tuple[str, int]:
                return r.choices[0].text, r.usage.completion_tokens

            async def all_at_once():
                return [seen(r) for r in await asyncio.gather(
                    *(oa.completions.create(model=n, prompt=q, **ask) for n, q in keys))]

            alone = {(n, q): seen(oa_sync(c).completions.create(model=n, prompt=q, **ask)) for n, q in keys}
            assert dict(zip(keys, asyncio.run(all_at_once()), strict=True)) == alone
            assert len({tuple(v for (n, _), v in alone.items() if n == name) for name, _ in lora_runs}) == 3

        killed_is_one_line(engine, lora_runs, "llama.cpp")
    finally:
        engine.close()


def test_a_missing_or_broken_llama_server_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("GPUWISE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("GPUWISE_LLAMA_CPP", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert "--llama-server /nonexistent/llama-server: no such executable" in one_line_error(
        capsys, [BASE, "--engine", "llama.cpp", "--llama-server", "/nonexistent/llama-server"])
    assert "--engine llama.cpp: llama-server is not installed here: run `make llama.cpp`" in one_line_error(
        capsys, [BASE, "--engine", "llama.cpp"])
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\nkill -ILL $$\n")  # a build for another CPU dies of SIGILL
    broken.chmod(0o755)
    line = one_line_error(capsys, [BASE, "--engine", "llama.cpp", "--llama-server", str(broken)])
    assert "--version failed (killed by signal 4): rebuild it with `make llama.cpp`" in line, line
    assert "--dtype q8_0 is llama.cpp's" in one_line_error(capsys, [BASE, "--engine", "gpuwise", "--dtype", "q8_0"])


def test_the_auto_rule_reads_device_adapters_and_the_measured_speed_at_the_streams_expected(monkeypatch):
    """plan/engines.py auto_engine: on a CPU, a quantized GGUF is served the way least behind the fastest at any
    measured level from one stream to the streams expected (CPU_TOK_S, the table docs/serving.md measures), of
    gpuwise's engine on the file's own blocks, gpuwise's on them in bf16, and llama.cpp; within SAME_SPEED of the
    best such share the first of those; the figures it decided on are in its line."""
    from gpuwise.plan import engines

    assert auto_engine("cuda", True, True, "q4_1", 1).engine == "vllm"
    assert auto_engine("cuda", False, True, "q4_1", 1).engine == "gpuwise"
    assert auto_engine("cpu", False, True, "q4_1", 1, adapters=True).engine == "gpuwise"
    plain = auto_engine("cpu", False, True, None, 1)  # bf16 or fp32 weights: gpuwise's engine
    assert plain.engine == "gpuwise" and plain.weights is None

    def check(gguf: str, blocks: str, streams: int, installed: bool = True) -> None:
        levels = [i for i, n in enumerate(engines.STREAM_LEVELS) if n <= streams]
        names = [("gpuwise", w, f"gpuwise {w}") for w in (blocks, "bf16")]
        names += [("llama.cpp", None, f"llama.cpp {gguf}")] if installed else []
        speeds = {(e, w): [engines.CPU_TOK_S[key][i] for i in levels] for e, w, key in names}
        fastest = [max(v[j] for v in speeds.values()) for j in range(len(levels))]
        worst = {way: min(v[j] / fastest[j] for j in range(len(levels))) for way, v in speeds.items()}
        best = max(worst.values())
        choice = auto_engine("cpu", False, installed, gguf, streams)
        picked = (choice.engine, choice.weights)
        assert picked in worst and worst[picked] >= engines.SAME_SPEED * best, (gguf, streams, choice)
        before = list(worst)[: list(worst).index(picked)]
        assert all(worst[way] < engines.SAME_SPEED * best for way in before), (gguf, streams, choice)  # the first
        assert all(f"{x:.0f}" in choice.why for v in speeds.values() for x in v)
        assert engines.CPU_TOK_S_SOURCE in choice.why

    for gguf, blocks in (("q4_1", "int4"), ("q8_0", "int8")):
        for streams in (1, 4, 8, 31, 32, 64):
            check(gguf, blocks, streams)
            check(gguf, blocks, streams, installed=False)
    # the rule follows the table: llama.cpp where it is measured well ahead, gpuwise's engine where it is
    table = dict(engines.CPU_TOK_S)
    monkeypatch.setitem(engines.CPU_TOK_S, "llama.cpp q4_1", tuple(x * 10 for x in table["gpuwise bf16"]))
    assert auto_engine("cpu", False, True, "q4_1", 1).engine == "llama.cpp"
    nowhere = auto_engine("cpu", False, False, "q4_1", 1)  # ... where it is installed
    assert nowhere.engine == "gpuwise" and "make llama.cpp" in nowhere.why
    monkeypatch.setitem(engines.CPU_TOK_S, "llama.cpp q4_1", (1.0, 1.0, 1.0))
    monkeypatch.setitem(engines.CPU_TOK_S, "gpuwise int4", tuple(x * 0.95 for x in table["gpuwise bf16"]))
    assert auto_engine("cpu", False, True, "q4_1", 8).weights == "int4"  # the same speed: the file's blocks
    monkeypatch.setitem(engines.CPU_TOK_S, "gpuwise int4", tuple(x * 0.5 for x in table["gpuwise bf16"]))
    choice = auto_engine("cpu", False, True, "q4_1", 8)
    assert choice.weights == "bf16" and "dequantized to bf16" in choice.why
    # a type gpuwise's kernels do not hold as --weights: its bf16 against llama.cpp at those bits
    assert auto_engine("cpu", False, True, "q4_0", 1).weights in ("bf16", None)

    from gpuwise.plan.engines import serving_plan

    plan = {"precision": "bf16", "layout": {}, "model": {"name": BASE}, "seq": 512, "batch": 1, "max_batch": 8}
    for batch in (1, 8, 32):  # --batch: the streams expected
        planned = serving_plan(plan | {"batch": batch}, BASE, "", 64, "cpu")
        assert planned["engine"] == auto_engine("cpu", True, True, "q4_1", batch).engine, planned
        assert "a Q4_1 GGUF on a CPU" in planned["why"]


def test_serve_auto_on_the_named_base_takes_the_engine_the_table_says_and_the_files_blocks():
    """`gpuwise serve BASE` (`--engine auto`, as `choose_engine` reads it) with llama.cpp installed: the way
    auto_engine reads off the measured table, gpuwise's engine holding the file's Q4_1 blocks (--weights int4) or
    them in bf16; a model given in bf16 is gpuwise's in bf16; `--engine gpuwise` on the file holds it the faster
    of gpuwise's two ways."""
    from gpuwise.plan import engines
    from gpuwise.serve.engines.choose import choose_engine
    from gpuwise.serve.engines.gpuwise import attention

    binary = str(llama_server())
    here = attention.unavailable()  # where gpuwise's kernels cannot run, the table does not hold (next test)
    for streams in (1, 8, 32):
        chosen = choose_engine("auto", [(BASE, BASE)], streams, "auto", llama_server=binary)
        rule = auto_engine("cpu", False, True, "q4_1", streams, no_kernels=here, isa=attention.isa())
        assert (chosen.engine, chosen.weights) == (rule.engine, rule.weights), (chosen, rule)
        assert (chosen.llama_server is not None) == (chosen.engine == "llama.cpp")
    bf16 = choose_engine("auto", [(BASE, BASE)], 1, "bf16", llama_server=binary)
    assert bf16.engine == "gpuwise" and bf16.weights is None
    for streams in (1, 32):  # --engine gpuwise: the faster of its two ways, as auto measures them
        rule = auto_engine("cpu", False, False, "q4_1", streams, no_kernels=here, isa=attention.isa())
        assert choose_engine("gpuwise", [(BASE, BASE)], streams, "auto").weights == rule.weights
    assert rule.weights in (("bf16", engines.GGUF_WEIGHTS["q4_1"]) if not here else (None,))


def test_without_gpuwise_kernels_a_gguf_goes_to_llama_cpp_and_the_line_says_why(monkeypatch):
    """CPU_TOK_S was measured with gpuwise's decode kernels. On a CPU where they cannot run (no AVX-512, no
    compiler, GPUWISE_KERNELS=0: attention.unavailable), a quantized GGUF goes to llama.cpp where it is installed,
    else to gpuwise's engine at --dtype's precision (int8 and int4 need the kernels; bf16 is not forced on a CPU
    that only emulates it); the line says why. A model in bf16 stays gpuwise's, the reason in its line."""
    from gpuwise.plan import engines
    from gpuwise.serve.engines.choose import choose_engine
    from gpuwise.serve.engines.gpuwise import attention

    why = "this CPU's PyTorch dispatch level is AVX2, not AVX-512"
    for gguf in ("q4_1", "q8_0", "q4_0"):
        for streams in (1, 8, 32):
            there = auto_engine("cpu", False, True, gguf, streams, no_kernels=why)
            assert there.engine == "llama.cpp" and why in there.why and engines.CPU_TOK_S_SOURCE in there.why
            alone = auto_engine("cpu", False, False, gguf, streams, no_kernels=why)
            assert (alone.engine, alone.weights) == ("gpuwise", None) and why in alone.why
            assert "make llama.cpp" in alone.why
    plain = auto_engine("cpu", False, True, None, 1, no_kernels=why)
    assert plain.engine == "gpuwise" and plain.weights is None and why in plain.why
    assert auto_engine("cpu", False, True, "q4_1", 1, adapters=True, no_kernels=why).engine == "gpuwise"
    assert auto_engine("cuda", False, True, "q4_1", 1, no_kernels=why).engine == "gpuwise"  # not a CPU's kernels

    monkeypatch.setenv("GPUWISE_KERNELS", "0")
    assert attention.unavailable() == "GPUWISE_KERNELS=0"
    chosen = choose_engine("auto", [(BASE, BASE)], 1, "auto", llama_server=str(llama_server()))
    assert chosen.engine == "llama.cpp" and "GPUWISE_KERNELS=0" in chosen.why and chosen.llama_server is not None
    assert choose_engine("gpuwise", [(BASE, BASE)], 1, "auto").weights is None


def test_a_child_engine_inherits_what_the_user_set_not_what_gpuwise_set_for_itself(monkeypatch):
    """gpuwise serve's OMP_WAIT_POLICY=PASSIVE is for its own engine's threads; an engine server it starts gets
    the user's environment, with the user's own OMP_WAIT_POLICY where there is one."""
    from gpuwise.serve.engines.child import OWN_ONLY, child_environ

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv(OWN_ONLY, "OMP_WAIT_POLICY")
    monkeypatch.setenv("HF_HOME", "/somewhere")
    env = child_environ({"LLAMA_API_KEY": "k"})
    assert "OMP_WAIT_POLICY" not in env and OWN_ONLY not in env
    assert env["HF_HOME"] == "/somewhere" and env["LLAMA_API_KEY"] == "k"
    monkeypatch.delenv(OWN_ONLY)  # the user's own setting: passed on
    assert child_environ({})["OMP_WAIT_POLICY"] == "PASSIVE"
