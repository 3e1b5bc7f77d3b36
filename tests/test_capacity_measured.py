"""The serving capacity plan on this machine: `gpuwise bench --serve`'s measured steps calibrate it, and the
same Poisson arrivals replayed against `gpuwise serve` come out as the plan said (a looser version of
benchmarks/capacity_vs_actual.py's bars, on a tiny model so that it takes under a minute)."""

import asyncio
import json
import time

import httpx
import pytest

from gpuwise.bench import serving as bs
from gpuwise.cli import main
from gpuwise.hardware.catalog import load_catalog
from gpuwise.hardware.cpu import detect_cpu
from gpuwise.hardware.devices import here
from gpuwise.plan.capacity import goodput, measured_replica, run_at
from gpuwise.plan.model import resolve_model
from gpuwise.plan.simulate import percentile, poisson
from gpuwise.plan.traffic import Targets, Traffic
from gpuwise.runs import db


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuwise.workloads.product_lm import train_tokenizer

    path = tmp_path_factory.mktemp("capacity-model")
    tok = train_tokenizer(["the coffee is good", "my dog likes it", "tea was bad"] * 20, vocab=200)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tok.eos_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def measured(model_dir):
    mp = pytest.MonkeyPatch()
    mp.setattr(bs, "PREFILL", (16, 128, 256))
    mp.setattr(bs, "DECODE", ((1, 32), (4, 32), (8, 32), (1, 256)))
    mp.setattr(bs, "GEN", 16)
    mp.setattr(bs, "REPEATS", 1)
    try:
        yield bs.bench_serve(str(model_dir), "gpuwise", "fp32", detect_cpu().model)
    finally:
        mp.undo()


def test_the_fit_holds_the_points_it_was_fitted_on(measured):
    assert {"a", "b", "c", "d", "e", "request_s"} <= set(measured["fit"]) and min(measured["fit"].values()) >= 0
    assert len(measured["points"]) == 7
    for p in measured["points"]:
        assert p["seconds"] > 0
        assert p["fitted"] == pytest.approx(p["seconds"], rel=0.6), p  # a noisy CPU; the replay below is the check
    lim = measured["limits"]
    assert lim["max_seqs"] == bs.MAX_SEQS and lim["kv_tokens"] >= bs.CONTEXT and lim["chunk_ratio"] == 1.5
    # measured as `gpuwise serve` runs by default: on a CPU, a core left to the front end
    assert measured["engine_line"].startswith("engine: gpuwise") and "compute thread" in measured["engine_line"]


def test_replayed_arrivals_come_out_as_planned(measured, model_dir, tmp_path, capsys):
    # Half the planned knee (at most 5 requests/s): throughput is the offered load, for plan and server alike.
    targets, traffic = Targets(1.0, 0.1, 95), Traffic(1.0, 64, 16, "test")
    replica = measured_replica(resolve_model(str(model_dir / "config.json")), here(load_catalog())[0],
                               measured | {"id": 0})  # fmt: skip
    knee = goodput(replica, traffic, targets, n=200).rate
    assert knee > 0
    rate = min(knee / 2, 5.0)  # a tiny model's knee lies beyond what one Python client sends on time
    arrivals = poisson(rate, 40, 64, 16, seed=0)
    planned = run_at(replica, traffic, targets, rate, n=40).point()
    # the measurement recorded, `gpuwise serve` says at start what it holds, and records its session when it stops
    db.record("bench-serve", "cpu", str(model_dir), measured | {"model": str(model_dir)})
    log = tmp_path / "serve.log"
    proc, url, served = bs.start_server(str(model_dir), "gpuwise", "fp32", log, ("--json",))
    try:
        startup = httpx.get(url.removesuffix("/v1") + "/v1/info").json()["serving"]["goodput"]
        results = asyncio.run(_replay(url, served, arrivals))
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert startup["goodput_rps"] > 0 and "measured by gpuwise bench --serve" in startup["source"]
    said = f"goodput at TTFT <= 2 s and TPOT <= 0.2 s for 95 % of requests: {startup['goodput_rps']:.3g} requests/s"
    # --json: the start-up plan as one JSON object on stdout (the log holds stderr too), the banner's figures
    text = log.read_text()
    printed, _ = json.JSONDecoder().raw_decode(text[text.index("{\n"):])
    assert printed["url"] == url and printed["engine"] == "gpuwise" and printed["device"] == "cpu"
    assert printed["goodput"] == startup and printed["goodput_line"].startswith(said)
    assert any("forward: " in line for line in printed["plan"]) and "serving " not in text, printed["plan"]
    assert "compute thread" in printed["engine_why"] and printed["plan"][0].startswith("engine: gpuwise")
    assert "gpuwise_request_time_per_output_token_seconds_count 40.0" in metrics
    kept = results[4:]
    throughput = sum(r["tokens"] for r in results) / max(r["end"] for r in results)
    assert throughput == pytest.approx(planned["throughput"], rel=0.25)
    # Every request was answered in full, and as the targets the plan met. The latencies themselves are not
    # compared here: this model's steps take a fraction of a millisecond, below the streaming overhead a token
    # pays outside the step; the benchmark compares them on SmolLM2 (docs/benchmarks.md).
    assert all(r["tokens"] == 16 for r in results)
    assert percentile([r["tpot"] for r in kept], 95) <= targets.tpot and planned["attainment"] >= 0.95
    # the session's record: what it met, measured by the server, beside the plan at the same traffic
    (session,) = db.rows("serve")
    actual, expected = session["data"]["actual"], session["data"]["planned"]
    assert actual["requests"] == 40 and actual["output_tokens"] == 16 and actual["prompt_tokens"] > 0
    assert actual["rate_rps"] == pytest.approx(40 / max(r["end"] for r in results), rel=0.25)
    assert actual["attainment"] == 1.0 and expected["attainment"] >= 0.95
    assert 0 < actual["tpot_p95"] <= targets.tpot and expected["goodput_rps"] > actual["rate_rps"]
    assert main(["runs"]) == 0
    assert "served 40 at" in capsys.readouterr().out


async def _replay(url, model, arrivals):
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.perf_counter()

        async def one(at):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            r = await bs.stream(client, url, model, bs.words(64), 16)
            return {"ttft": r["ttft"], "tpot": bs.tpot(r), "tokens": r["usage"]["completion_tokens"],
                    "end": r["times"][-1] - t0}  # fmt: skip

        return await asyncio.gather(*(one(a.arrive) for a in arrivals))


def test_plan_task_serve_on_this_cpu_reads_the_measurement(measured, model_dir, capsys):
    config = str(model_dir / "config.json")
    # no measurement of this model here yet: the CPU's row says how to make one
    assert main(["plan", "--model", config, "--task", "serve", "--gpu", "cpu", "--rps", "1",
                 "--prompt-tokens", "64", "--output-tokens", "16", "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)["options"]
    assert not row["meets"] and "gpuwise bench --serve" in row["why"]
    db.record("bench-serve", "cpu", config, measured | {"model": config})
    assert main(["plan", "--model", config, "--task", "serve", "--gpu", "cpu", "--rps", "1",
                 "--prompt-tokens", "64", "--output-tokens", "16", "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)["options"]
    assert row["gpu"] == "cpu (gpuwise)" and row["meets"] and row["goodput_per_replica"] > 0
    assert "measured by gpuwise bench --serve" in row["step_source"]
    # a server is planned from a measurement of the weights it holds (the server's /v1/info says them)
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.plan.endpoint import endpoint_replica

    assert measured["weights"] == "fp32"
    replica, why = endpoint_replica(config, "gpuwise", "cpu", "fp32", load_catalog(), "fp32")
    assert replica is not None and "record #" in replica.source, why
    none, why = endpoint_replica(config, "gpuwise", "cpu", "fp32", load_catalog(), "int4")
    assert none is None and f"gpuwise bench --serve {config} --engine gpuwise --weights int4" in why
    assert main(["runs"]) == 0
    assert "gpuwise steps" in capsys.readouterr().out


def test_bench_serve_refuses_bad_flags(capsys):
    assert main(["bench", "--serve", "x", "--engine", "tgi"]) == 2
    assert "--engine tgi: must be one of gpuwise, vllm, llama.cpp" in capsys.readouterr().err
    assert main(["bench", "--engine", "vllm"]) == 2
    assert "--engine, --dtype and --weights apply to --serve MODEL" in capsys.readouterr().err
    assert main(["bench", "--serve", "x", "--weights", "int3"]) == 2
    assert "--weights int3: choose auto, bf16, int8, int4" in capsys.readouterr().err
    assert main(["bench", "--serve", "x", "--engine", "llama.cpp", "--weights", "int4"]) == 2
    assert "--weights is gpuwise's engine's" in capsys.readouterr().err
    assert main(["bench", "--serve", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpuwise: error: ") and err.count("\n") == 1
