"""The OpenAI API of a served language model, driven by the official `openai` client (sync and async) and by
the raw calls Open WebUI makes, against a real uvicorn on loopback. The model is product-lm's small scratch
Llama (one training step; fp32), so the answers are nonsense but greedy ones are reproducible."""

import asyncio
import codecs
import json
import time

import httpx
import openai
import pytest
import torch
from serving import Engine, Server, freed, generated, give_up, tiny_chat_model, trained

from gpuwise.plan.serving import KV_BLOCK
from gpuwise.serve.engines.gpuwise.packed import packing

MODEL = "product-lm"  # the run directory's name, which the server gives as the model id


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUWISE_DB", str(tmp / "runs.sqlite"))
        return trained(tmp, "product-lm")


@pytest.fixture(scope="module", params=["gpuwise", "vllm", "llama.cpp"])
def engine(request, run):
    """The engine behind the routes: gpuwise's own (None), or vLLM's CPU build or llama.cpp, started once for
    the module (fp32, 4 sequences) with each test's server a front end of its own."""
    if request.param == "gpuwise":
        yield None
        return
    started = Engine(request.param, [(MODEL, str(run))])
    yield started
    started.close()


def client(c: httpx.Client, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key=key, max_retries=0)


def test_models_chat_and_completions_through_the_official_client(run, engine):
    with Server(run, engine=engine, limits={"max_tokens": 64}) as c:
        oa = client(c)
        assert [m.id for m in oa.models.list().data] == [MODEL]
        chat = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Review this coffee"}], max_tokens=12, temperature=0
        )
        answer = chat.choices[0]
        assert answer.message.role == "assistant" and answer.finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

        stream = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Review this coffee"}], max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer.message.content
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == answer.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

        text = oa.completions.create(model=MODEL, prompt="This coffee", max_tokens=10, temperature=0)
        assert text.choices[0].finish_reason == "length" or text.usage.completion_tokens < 10
        pieces = oa.completions.create(model=MODEL, prompt="This coffee", max_tokens=10, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in pieces if p.choices) == text.choices[0].text
        if len(text.choices[0].text) > 3:
            stop = text.choices[0].text[2:4]
            cut = oa.completions.create(model=MODEL, prompt="This coffee", max_tokens=10, temperature=0, stop=stop)
            full = text.choices[0].text
            assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"

        seeded = [oa.completions.create(model=MODEL, prompt="My dog", max_tokens=8, temperature=1.0, seed=7)
                  for _ in range(2)]
        assert seeded[0].choices[0].text == seeded[1].choices[0].text


def test_each_error_is_openai_shaped(run, engine):
    with Server(run, engine=engine, api_key="k3y", limits={"max_tokens": 64}) as c:
        oa = client(c, "k3y")
        with pytest.raises(openai.AuthenticationError):
            client(c, "wrong").models.list()
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' not found; this server serves: product-lm"):
            oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.UnprocessableEntityError, match="only n=1"):
            oa.completions.create(model=MODEL, prompt="x", n=2)
        with pytest.raises(openai.BadRequestError, match="at most 64 on this server"):
            oa.completions.create(model=MODEL, prompt="x", max_tokens=65)
        with pytest.raises(openai.BadRequestError, match="context is 512 tokens"):
            oa.completions.create(model=MODEL, prompt="coffee " * 600, max_tokens=1)
        with pytest.raises(openai.APIStatusError, match="at most 8,000") as too_long:
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 9000}])
        assert too_long.value.status_code == 413
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 9999},
                   headers={"Authorization": "Bearer k3y"})
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error" and set(error) == {
            "message", "type", "param", "code"}


def test_the_open_webui_call_pattern(run, engine):
    """Open WebUI lists the models with its Bearer key, then streams chats with fields of its own."""
    with Server(run, engine=engine, api_key="sk-webui") as c:
        auth = {"Authorization": "Bearer sk-webui"}
        assert c.get("/v1/models").status_code == 401
        models = c.get("/v1/models", headers=auth).json()
        assert models["object"] == "list" and models["data"][0]["object"] == "model" and "created" in models["data"][0]
        body = {"model": MODEL, "stream": True, "messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Hi"}],
                "metadata": {"chat_id": "x"}, "frequency_penalty": 0, "logit_bias": {}, "max_tokens": 6,
                "stream_options": {"include_usage": True}, "params": {}, "tool_ids": None}
        with c.stream("POST", "/v1/chat/completions", json=body, headers=auth) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            assert s.headers["x-accel-buffering"] == "no"
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert chunks[-1]["usage"]["total_tokens"] > 0


def engine_freed(engine, why: str) -> None:
    """The engine's own count of running requests falls to 0 (vLLM's metrics, llama.cpp's /slots): the dropped
    stream was aborted inside it."""
    if engine is None:
        return
    server = engine.backends[0][0].server
    deadline = time.time() + 15  # a loaded 2-core machine: llama.cpp once took over 5 s
    while True:
        if engine.name == "vllm":
            text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
            running = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:num_requests_running")]
        else:
            slots = httpx.get(f"{server.url}/slots", headers=server.headers).json()
            running = [float(slot["is_processing"]) for slot in slots]
        if running and sum(running) == 0:
            return
        assert time.time() < deadline, f"{why}: {engine.name} still runs {running}"
        time.sleep(0.05)


def test_a_disconnect_mid_stream_frees_the_slot_and_a_full_queue_is_a_429(run, engine):
    server = Server(run, engine=engine, limits={"max_tokens": 500, "max_seqs": 1, "max_queue": 1})
    with server as c:
        ask = {"model": MODEL, "prompt": "This coffee", "max_tokens": 500, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=ask) as s:
            next(line for line in s.iter_lines() if line.startswith("data: "))
        freed(c, "the dropped stream still holds its slot")
        engine_freed(engine, "the dropped stream")
        # A client that gives up on a whole (non-streaming) answer frees its slot too, and its generation
        # stops there: it does not run on to max_tokens for nobody.
        before = generated(c)
        give_up(server, "/v1/completions", ask | {"stream": False}, engine)
        freed(c, "the abandoned request still holds its slot")
        engine_freed(engine, "the abandoned request")
        assert generated(c) - before < ask["max_tokens"]

        async def crowd():
            oa = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)
            calls = [oa.completions.create(model=MODEL, prompt="x", max_tokens=300, temperature=0) for _ in range(4)]
            return await asyncio.gather(*calls, return_exceptions=True)

        # one runs, one waits, the others are turned away: four requests sent at once, against the 300 steps
        # the first one runs, whatever the host's speed
        results = asyncio.run(crowd())
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert len(refused) >= 1 and refused[0].response.headers["retry-after"] == "1"
        assert all(not isinstance(r, Exception) or isinstance(r, openai.RateLimitError) for r in results), results


def test_greedy_answers_are_the_same_alone_and_in_a_crowd_with_no_5xx(run, engine):
    """Eight greedy answers, alone, then among 200 sampled chats: the same (under llama.cpp, the same up to a
    token where its top two are a rounding apart: llama_cpp_parts_at_a_near_tie), and no 5xx."""
    prompts = [f"My {w} is" for w in ("dog", "cat", "tea", "coffee", "food", "order", "box", "bag")]
    # fp32: under bf16 (auto on an AMX CPU) a row's rounding may depend on the batch it is decoded in
    server = Server(run, engine=engine, limits={"max_tokens": 16}, dtype="fp32")
    with server as c:
        oa = client(c)
        alone = [oa.completions.create(model=MODEL, prompt=q, max_tokens=16, temperature=0).choices[0].text
                 for q in prompts]

        async def load(n: int):
            oa = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="x", max_retries=0)
            gate = asyncio.Semaphore(32)

            async def one(i):
                async with gate:
                    r = await oa.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": prompts[i % 8]}], max_tokens=4,
                        temperature=0.7, stream=bool(i % 2))
                    if i % 2:
                        return [ch async for ch in r]
                    return r

            async def greedy(q):
                r = await oa.completions.create(model=MODEL, prompt=q, max_tokens=16, temperature=0)
                return r.choices[0].text

            crowd = asyncio.gather(*(one(i) for i in range(n)))
            await asyncio.sleep(0.2)  # the greedy ones join a batch that is already full
            return await asyncio.gather(crowd, asyncio.gather(*map(greedy, prompts)))

        answers, crowded = asyncio.run(load(200))
        if engine is not None and engine.name == "llama.cpp":
            for q, a, b in zip(prompts, alone, crowded, strict=True):
                if a != b:
                    llama_cpp_parts_at_a_near_tie(engine, server, q, [a, b])
            with pytest.raises(AssertionError, match="not a tie"):  # another prompt's answer parts at no tie
                llama_cpp_parts_at_a_near_tie(engine, server, prompts[0], [alone[1]])
        else:
            assert crowded == alone
        assert len(answers) == 200
        metrics = c.get("/metrics").text
        assert 'status="5' not in metrics and "gpuwise_internal_errors_total 0.0" in metrics
        assert "gpuwise_time_to_first_token_seconds_count" in metrics


NEAR_TIE = 1e-3  # nats between the top two tokens: fp32 sums in another order move a logit by ~1e-6 of itself


def llama_cpp_parts_at_a_near_tie(engine: Engine, front: Server, prompt: str, answers: list[str]) -> None:
    """llama.cpp does not promise a sequence the same sums in a batch as alone: its CPU products and its KV cache
    shared by the slots sum in an order that follows the batch (llama.cpp PR #6950: "does not produce bit-for-bit
    identical results as the batch size is changed"), so greedy answers may part where the top two tokens are a
    rounding apart. Each answer must follow llama.cpp's own greedy path for this prompt, asked alone with the top
    two log-probabilities at each token, up to a token where those two are within NEAR_TIE."""
    backend = front.served.model(MODEL)[0]
    server = engine.backends[0][0].server
    r = httpx.post(f"{server.url}/completion", headers=server.headers, timeout=60, json={
        "prompt": backend.tok(prompt)["input_ids"], "n_predict": 16, "temperature": 0.0, "n_probs": 2,
        "cache_prompt": False, "samplers": ["top_p", "temperature"], "top_k": 0, "min_p": 0.0,
    })  # fmt: skip
    r.raise_for_status()
    path = r.json()["completion_probabilities"]
    for answer in answers:
        # the path's text as llama.cpp's own pieces give it: its tokens' bytes, a character split across tokens
        # held until it is whole, bytes that are no character each a U+FFFD, as in the answers
        decoder, text, parted = codecs.getincrementaldecoder("utf-8")(errors="replace"), "", None
        for k, token in enumerate(path):
            text += decoder.decode(bytes(token["bytes"]))
            if not answer.startswith(text):
                parted = k
                break
        if parted is None:
            continue
        top = sorted((t["logprob"] for t in path[parted]["top_logprobs"]), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (
            f"{prompt!r}: {answer!r} left llama.cpp's greedy path {r.json()['content']!r} at token {parted}, "
            f"where its top two log-probabilities are {top[:2]}: not a tie that rounding could break"
        )


# --- models given directly: a named base, a model directory ------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


def test_a_model_directory_is_served_with_its_chat_template_and_its_plan(model_dir):
    server = Server(model_dir, limits={"max_tokens": 8}, cors_origins=["http://chat.example"], api_key="k")
    with server as c:
        llm, oa = server.served, client(c, "k")
        assert [m.id for m in oa.models.list().data] == ["tiny-chat"]
        # greedy both times: a sampled answer of this random model ends early when it draws the end token
        r = oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0)
        templated = llm.tok("<user>hi\n<assistant>", add_special_tokens=False)["input_ids"]
        assert r.usage.prompt_tokens == len(templated)  # the model's own template, not the plain fallback
        again = oa.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4, temperature=0)
        assert again.usage == r.usage
        # the same prompt again: found in the prefix cache, its whole KV blocks before its last token's, and
        # /metrics says so
        metrics = c.get("/metrics", headers={"Authorization": "Bearer k"}).text
        count = {x.split()[0]: float(x.split()[1]) for x in metrics.splitlines()
                 if x.startswith("gpuwise_prefix_cache_")}
        assert count["gpuwise_prefix_cache_hits_total"] == (len(templated) - 1) // KV_BLOCK * KV_BLOCK > 0
        assert count["gpuwise_prefix_cache_queries_total"] == 2 * len(templated)
        preflight = c.options("/v1/chat/completions", headers={  # a browser asks before it sends the key
            "Origin": "http://chat.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://chat.example"
    # the KV cache the engine allocates is what `gpuwise plan` counts: 2 x 2 layers x 1 KV head x 16 x 4 bytes
    # in fp32, 2 in bf16 (--dtype auto's choice on a CPU with AMX or AVX512-BF16)
    width = {"fp32": 4, "bf16": 2}[llm.precision]
    assert llm.engine.cache.bytes_per_token() == llm.backends[0].serving.kv_bytes_per_token == 2 * 2 * 1 * 16 * width
    assert "budget" in llm.plan() and "KiB per token" in llm.plan() and "blocks of 16" in llm.plan()
    assert "prefix cache 4,096 prompt tokens" in llm.plan()
    # a Llama: the fused decoder serves it; on a CPU its products are packed, for oneDNN (for MKL in fp32 where
    # oneDNN is missing): 2 layers x q/k/v, o, gate/up and down, and the output layer
    assert "forward: gpuwise's fused decoder" in llm.plan()
    kind = packing("cpu", {"fp32": torch.float32, "bf16": torch.bfloat16}[llm.precision])
    assert (f"9 weight matrices packed for {kind}" in llm.plan()) == (kind is not None)


def test_the_named_base_answers_a_chat(capsys):
    """SmolLM2-135M-Instruct (converted once per session), served by name, greedy: a real model's chat
    template, end-of-turn token and tokenizer, through the official client."""
    with Server("smollm2-135m-instruct", limits={"max_tokens": 24}) as c:
        r = client(c).chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer


@pytest.mark.parametrize("ref, needle", [
    ("/nonexistent/model", "no such run directory or model file"),
    ("EMPTY", "is not a gpuwise run directory (no config.yaml)"),
    ("--model=a=/nonexistent/x", "--model a=/nonexistent/x: no such run directory or model file"),
    ("--model=a=x --model=a=y", "the name 'a' is given twice"),
    ("--model==x", "give NAME=PATH"),
])
def test_serving_what_is_not_a_model_is_one_line(capsys, tmp_path, ref, needle):
    import socket

    from gpuwise.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ref = str(tmp_path) if ref == "EMPTY" else ref
    assert main(["serve", *ref.split(), "--port", port]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_chat_in_the_terminal_locally_and_against_a_server(capsys, monkeypatch, run, model_dir):
    import io

    from gpuwise.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n\n"))
    assert main(["chat", str(model_dir), "--max-tokens", "4", "--temperature", "0"]) == 0
    local = capsys.readouterr()
    assert "chatting with tiny-chat" in local.err and local.out.count("\n") == 1
    with Server(run, api_key="k") as c:
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
        assert main(["chat", str(c.base_url), "--api-key", "k", "--max-tokens", "3", "--temperature", "0"]) == 0
        remote = capsys.readouterr()
        assert "chatting with product-lm" in remote.err and remote.out.count("\n") == 2
        assert main(["chat", str(c.base_url), "--api-key", "wrong"]) == 2
        assert "answered 401" in capsys.readouterr().err


@pytest.mark.slow
def test_two_adapters_of_one_base_share_it_and_answer_each_its_own(capsys, tmp_path):
    """A full fine-tune as the base, two LoRA runs over it (different seeds and data order): one server, one
    copy of the base, the model field picks the adapter per request, and each answers as it does alone."""
    from gpuwise.cli import main
    from gpuwise.serve.models import load_models
    from gpuwise.workloads.serving import Limits

    from train_data import reviews_jsonl

    data = reviews_jsonl(tmp_path / "r.jsonl")
    small = f"train product-lm --data {data} --block-size 32 --batch-size 4 --json"
    assert main(f"{small} --base scratch --method full --max-steps 1 --run-dir {tmp_path / 'base'}".split()) == 0
    for name, seed in (("a", 1), ("b", 2)):  # a high rate, so two steps move the greedy answers apart
        cmd = f"{small} --base {tmp_path / 'base' / 'model'} --method lora --lr 0.05 --max-steps 3 --seed {seed}"
        assert main(f"{cmd} --run-dir {tmp_path / name}".split()) == 0
    capsys.readouterr()
    ask = {"prompt": "This coffee", "max_tokens": 12, "temperature": 0}

    def answers(llm_models) -> dict:
        llm = load_models(llm_models, Limits())
        try:
            assert len(llm.backends) == 1  # one copy of the base for all of them
            backend = llm.backends[0]
            assert "forward: gpuwise's fused decoder" in backend.plan()  # the adapters too
            ids = backend.tok(ask["prompt"])["input_ids"]
            out = {}
            import threading
            import time as clock

            from gpuwise.serve.engines.base import Params, Sequence

            done = {n: threading.Event() for n, _ in llm_models}
            seqs = {}
            for n, _ in llm_models:  # all at once: one batch, a different adapter per row
                seqs[n] = Sequence(ids, Params(12, 0.0), lambda e, n=n: "finish" in e and done[n].set(),
                                   clock.monotonic() + 60, adapter=llm.route[n][1])
                backend.engine.submit(seqs[n])
            for n, _ in llm_models:
                assert done[n].wait(60)
                out[n] = seqs[n].out
            return out
        finally:
            llm.close()

    together = answers([("a", str(tmp_path / "a")), ("b", str(tmp_path / "b")), ("base", str(tmp_path / "base"))])
    assert together["a"] != together["b"] != together["base"]
    assert answers([("a", str(tmp_path / "a"))])["a"] == together["a"]
    assert answers([("b", str(tmp_path / "b"))])["b"] == together["b"]


def test_sampling_edges_and_huge_bodies_get_a_4xx_and_stall_no_one(run, engine):
    import threading

    with Server(run, engine=engine) as c:
        oa = client(c)
        # a top_p below float32's smallest number (0 there): the likeliest token, as greedy picks it
        tiny = oa.completions.create(model=MODEL, prompt="My dog", max_tokens=6, temperature=1.0, top_p=1e-320)
        greedy = oa.completions.create(model=MODEL, prompt="My dog", max_tokens=6, temperature=0)
        assert tiny.choices[0].text == greedy.choices[0].text
        for seed in (2**64, -(2**63) - 1, 10**30):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": seed})
            assert r.status_code == 422 and r.json()["error"]["message"].startswith("seed:"), r.text
        assert oa.completions.create(model=MODEL, prompt="x", max_tokens=2, seed=2**64 - 1).choices
        for bad in (b"[" * 100_000, b'{"model": "m", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", b"{"):
            r = c.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", content=b'{"model": "\xff"}', headers={"content-type": "application/json"})
        assert r.status_code == 400

        # 300,000 empty messages (9.9 MB): a 422, and /health answers all the while
        many = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 300_000}).encode()
        escaped = many.replace(b'"role"', b'"\\u0072ole"')  # past the cheap count: parsed, then bounded
        for body in (many, escaped):
            answer, gaps = {}, []

            def send(body=body, answer=answer):
                answer["r"] = httpx.post(f"{c.base_url}/v1/chat/completions", content=body, timeout=60,
                                         headers={"content-type": "application/json"})

            sender = threading.Thread(target=send)
            sender.start()
            while sender.is_alive():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                gaps.append(time.perf_counter() - t0)
            sender.join()
            assert answer["r"].status_code == 422 and "at most 4,096" in answer["r"].json()["error"]["message"]
            # The parse (off the event loop) holds the GIL while json reads the body, so /health may wait that
            # long, no more: bounded by 4 parses of the same body, timed here. Before, FastAPI's parse and
            # template ran on the event loop: one 4.7 s pause, some 35 parses.
            t0 = time.perf_counter()
            json.loads(escaped)
            parse = time.perf_counter() - t0
            assert max(gaps) < 4 * parse, (gaps, parse)
