"""`gpuwise ui`: its API answers what the CLI answers (the plan page and `gpuwise plan --json` agree), bad
input is a 400 with the CLI's one line and its field, the API key rule of `serve`, the Models page's calls reach
real `gpuwise serve` endpoints and answer what they answer; and a real headless Chromium (Debian's `chromium`,
driven by Playwright) fills the plan form, reads the answer and the error beside a field, opens a real run's page
and finds its curves, sets two runs side by side, streams a chat reply, drops an image on the defects model, and
saves screenshots."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from serving import Server, freed, generated, trained

from gpuwise.cli import main
from gpuwise.ui.app import create_app
from gpuwise.ui.endpoints import Endpoint

from train_data import image_folder

SHOTS = Path(os.environ.get("GPUWISE_UI_SHOTS", "")) if os.environ.get("GPUWISE_UI_SHOTS") else None


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uiruns")
    cells = image_folder(root / "cells", per_class=8, size=32)
    run = root / "runs" / "defects-tiny"
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 6 --run-dir {run}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUWISE_DB", str(root / "runs.sqlite"))
        assert main(args.split()) == 0
    return run


@pytest.fixture(scope="module")
def second_run(finished_run) -> Path:
    """A second run beside the first, other learning rate and length: the pair the compare page shows."""
    run = finished_run.parent / "defects-lr"
    cells = finished_run.parents[1] / "cells"
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 4 --lr 0.01 --run-dir {run}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUWISE_DB", str(finished_run.parents[1] / "runs.sqlite"))
        assert main(args.split()) == 0
    return run


@pytest.fixture(scope="module")
def endpoints(finished_run, tmp_path_factory):
    """Two real `gpuwise serve` endpoints (uvicorn threads on loopback): the defects run, which takes images,
    and product-lm's scratch Llama behind the OpenAI API and a key. Greedy answers are nonsense, but fixed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPUWISE_DB", str(tmp_path_factory.mktemp("lmdb") / "runs.sqlite"))
        lm = trained(tmp_path_factory.mktemp("lm"), "product-lm")
    images, chat = Server(finished_run), Server(lm, api_key="k", limits={"max_tokens": 500})
    with images as direct_images, chat as direct_chat:
        direct_chat.headers["Authorization"] = "Bearer k"
        yield [(images.url, None, direct_images), (chat.url, "k", direct_chat)]


def client(**kw) -> TestClient:
    """The ui's app in-process, reached as a browser on this machine reaches it (Host 127.0.0.1), carrying the
    per-launch token where the app made one (it holds an endpoint's key and no key of its own)."""
    app = create_app(**kw)
    auth = {"Authorization": f"Bearer {app.token}"} if app.token else {}
    return TestClient(app, base_url="http://127.0.0.1:8300", headers=auth)


def ui_client(runs_dir: Path, eps) -> TestClient:
    return client(runs_dir=runs_dir, endpoints=[Endpoint(url, key) for url, key, _ in eps])


def sse_text(body: str) -> tuple[str, dict]:
    """A streamed chat's text and its usage chunk, from the raw server-sent events."""
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:") and "[DONE]" not in line]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    return text, next(e["usage"] for e in events if e.get("usage"))


def test_the_models_page_lists_what_serve_would_serve_and_what_each_endpoint_answers(finished_run, endpoints):
    models = ui_client(finished_run.parent, endpoints).get("/api/models").json()
    assert {
        "name": finished_run.name,
        "kind": "defects",
        "path": str(finished_run),
        "command": f"gpuwise serve {finished_run}",
    } in models["servable"]
    images, chat = models["endpoints"]
    assert images["up"] and images["images"] and images["chat"] == [] and images["info"]["workload"] == "defects"
    assert chat["up"] and not chat["images"] and chat["chat"] == ["product-lm"]  # its key sent by the ui
    unkeyed = client(runs_dir=finished_run.parent, endpoints=[Endpoint(endpoints[1][0])])
    (refused,) = unkeyed.get("/api/models").json()["endpoints"]
    assert not refused["up"] and "missing or wrong API key" in refused["error"]


def test_a_chat_and_an_image_sent_through_the_ui_get_the_endpoints_own_answers(finished_run, endpoints):
    ui = ui_client(finished_run.parent, endpoints)
    png = next((finished_run.parents[1] / "cells" / "defective").iterdir())
    sent = {"file": (png.name, png.read_bytes(), "image/png")}
    through = ui.post("/api/endpoints/0/v1/predict", files=sent)
    assert through.status_code == 200 and through.json() == endpoints[0][2].post("/v1/predict", files=sent).json()
    ask = {
        "model": "product-lm",
        "messages": [{"role": "user", "content": "coffee"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    direct = endpoints[1][2].post("/v1/chat/completions", json=ask).json()
    streamed = ui.post(
        "/api/endpoints/1/v1/chat/completions", json={**ask, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    text, usage = sse_text(streamed.text)
    assert text == direct["choices"][0]["message"]["content"] and usage == direct["usage"]
    # the endpoint's own refusals pass through in its (OpenAI's) shape; the ui's own in one line
    wrong = ui.post("/api/endpoints/1/v1/chat/completions", json={**ask, "model": "nope"})
    assert wrong.status_code == 404 and "nope" in wrong.json()["error"]["message"]
    assert ui.get("/api/endpoints/7/v1/info").status_code == 404
    assert ui.get("/api/endpoints/0/metrics").status_code == 404  # only the page's own calls are forwarded


def test_an_endpoint_that_is_down_is_a_502_and_a_line_not_a_trace(finished_run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    ui = client(runs_dir=finished_run.parent, endpoints=[Endpoint(dead)])
    got = ui.post("/api/endpoints/0/v1/chat/completions", json={})
    assert got.status_code == 502 and got.json()["error"] == f"{dead} is not answering (ConnectError)"
    (down,) = ui.get("/api/models").json()["endpoints"]
    assert not down["up"] and "not answering" in down["error"]
    assert main(["ui", "--endpoint", "localhost:8000"]) == 2


def cli_plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("record_id")
    return out


@pytest.mark.parametrize(
    "query",
    ["model=llama-3.1-8b", "model=llama-3.1-8b&task=qlora&batch=4&seq=4096", "model=qwen2.5-7b&task=finetune&gpus=8"],
)
def test_the_plan_page_answers_what_gpuwise_plan_json_prints(capsys, query):
    params = dict(p.split("=") for p in query.split("&"))
    flags = [x for k, v in params.items() for x in (f"--{k}", v)]
    expected = cli_plan(capsys, *flags)
    got = client().get(f"/api/plan?{query}")
    assert got.status_code == 200
    assert got.json() == expected


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("model=llama-3.1-8b&batch=0", "batch", "--batch must be at least 1"),
        ("model=llama-3.1-8b&tp=3", "tp", "--tp 3 must divide llama-3.1-8b's 32 attention heads"),
        ("model=llama-3.1-8b&batch=x", "batch", "--batch must be a whole number, not 'x'"),
        ("model=llama-3.1-8b&utilization=nan", "utilization", "--utilization must be a finite number"),
        ("model=", "model", "give a model"),
        ("model=NOTAFILE.gguf", "model", "NOTAFILE.gguf"),
    ],
)
def test_bad_plan_input_is_a_400_with_the_clis_line_beside_its_field(capsys, tmp_path, query, field, message):
    got = client().get(f"/api/plan?{query}")
    assert got.status_code == 400
    assert got.json()["field"] == field and message in got.json()["error"]
    if "must divide" in message or "must be at least" in message:  # the planner's own checks: the CLI's words
        flags = [x for p in query.split("&") for x in (f"--{p.split('=')[0]}", p.split("=")[1])]
        assert main(["plan", *flags]) == 2
        assert got.json()["error"] in capsys.readouterr().err


SERVE_QUERY = "model=llama-3.1-8b&task=serve&rps=3&profile=chat&gpu=h100-sxm&ttft=1"


def query_flags(query: str) -> list[str]:
    return [x for p in query.split("&") for x in (f"--{p.split('=')[0].replace('_', '-')}", p.split("=")[1])]


def test_the_serving_form_answers_what_gpuwise_plan_task_serve_json_prints(capsys):
    expected = cli_plan(capsys, *query_flags(SERVE_QUERY))
    got = client().get(f"/api/plan?{SERVE_QUERY}")
    assert got.status_code == 200
    answer = got.json()
    assert answer.pop("warnings") == []  # the page shows them; the CLI prints them on stderr
    assert answer == expected
    assert [o["gpu"] for o in expected["options"]] == ["h100-sxm"] and expected["options"][0]["curve"]


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("rps=-1&profile=chat", "rps", "--rps must be above 0"),
        ("rps=x&profile=chat", "rps", "--rps must be a number, not 'x'"),
        ("profile=chat", "rps", "a serving plan needs the traffic"),
        ("rps=1&users=30&profile=chat", "rps", "give either --rps, or --users"),
        ("rps=1&profile=chatty", "profile", "unknown profile 'chatty'"),
        ("rps=1&prompt_tokens=100", "prompt_tokens", "a serving plan needs the request lengths"),
        ("rps=1&profile=chat&tpot=0", "tpot", "--tpot must be above 0"),
        ("rps=1&profile=chat&hours_per_day=25", "hours_per_day", "--hours-per-day must be above 0 and at most 24"),
        ("rps=1&profile=chat&gpu=h900", "gpu", "unknown accelerator 'h900'"),
    ],
)
def test_bad_serving_input_is_a_400_with_the_clis_line_beside_its_field(capsys, query, field, message):
    got = client().get(f"/api/plan?model=llama-3.1-8b&task=serve&{query}")
    assert got.status_code == 400
    assert got.json()["field"] == field and message in got.json()["error"]
    assert main(["plan", "--model", "llama-3.1-8b", "--task", "serve", *query_flags(query)]) == 2
    if "must be a number" not in message:  # the CLI's parser words its own; every other line is the planner's
        assert got.json()["error"] in capsys.readouterr().err


def test_a_non_model_file_is_refused_in_one_line(tmp_path):
    junk = tmp_path / "photo.gguf"
    junk.write_bytes(b"\x89PNG not a model")
    got = client().get(f"/api/plan?model={junk}")
    assert got.status_code == 400 and got.json()["field"] == "model" and "\n" not in got.json()["error"]


def test_the_runs_api_lists_a_finished_run_with_its_curves_and_planned_beside_measured(finished_run):
    ui = client(runs_dir=finished_run.parent)
    rows = ui.get("/api/runs").json()
    assert [(r["key"], r["status"], r["workload"]) for r in rows] == [("defects-tiny", "finished", "defects")]
    assert ui.get("/api/runs?status=running").json() == []
    run = ui.get("/api/runs/defects-tiny").json()
    assert [p[0] for p in run["curves"]["loss"]] == list(range(1, 7))
    assert run["summary"]["actual"]["peak_bytes"] > 0 and run["config"]["max_steps"] == 6
    assert ui.get("/runs/defects-tiny/report").text.startswith("<!doctype html>")
    for bad in ("..", "nope", "999", "٣", "３"):  # int() reads '٣' as record 3: ASCII digits only
        got = ui.get(f"/api/runs/{bad}")
        message = got.json().get("error") or got.json()["detail"]  # '..': no route (the client drops it)
        assert got.status_code in (400, 404) and "\n" not in message, (bad, got.text)


def test_with_a_key_every_data_path_needs_it_and_the_page_does_not(finished_run):
    ui = client(runs_dir=finished_run.parent, key="s3cret")
    assert ui.get("/").status_code == 200 and ui.get("/static/app.js").status_code == 200
    assert ui.get("/api/plan?model=llama-3.1-8b").status_code == 401
    assert ui.get("/runs/defects-tiny/report").status_code == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert ui.get("/api/plan?model=llama-3.1-8b", headers=ok).status_code == 200
    ui.cookies.set("gpuwise_key", "s3cret")  # what the page sets for its links
    assert ui.get("/runs/defects-tiny/report").status_code == 200


def test_off_loopback_without_a_key_is_refused(capsys):
    assert main(["ui", "--host", "0.0.0.0"]) == 2
    assert "set --api-key" in capsys.readouterr().err


def test_a_chat_the_page_stops_frees_the_endpoints_slot(launched, endpoints):
    """The page's Stop (or a closed tab) drops the forwarded stream; serve sees the disconnect and stops
    generating for nobody, as it does for a client of its own."""
    direct = endpoints[1][2]
    before = generated(direct)
    ask = {
        "model": "product-lm",
        "messages": [{"role": "user", "content": "my dog"}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    url, token = launched
    chat = f"{url}/api/endpoints/1/v1/chat/completions"
    assert httpx.post(chat, json=ask).status_code == 401  # the endpoint's key is lent to no one without the token
    with httpx.stream("POST", chat, json=ask, timeout=30, headers={"Authorization": f"Bearer {token}"}) as s:
        assert s.status_code == 200, s.read()
        next(line for line in s.iter_lines() if line.startswith("data: "))
    freed(direct, "the stopped chat still holds its slot")
    assert generated(direct) - before < ask["max_tokens"]


# --- in a real browser ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ui(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, str, str | None]:
    """`gpuwise ui ARGS` on a free loopback port: the process, its URL, and the token of the URL it printed."""
    port = free_port()
    cmd = [sys.executable, "-m", "gpuwise", "ui", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed = proc.stdout.readline()  # "gpuwise ui on http://127.0.0.1:PORT/[?token=...] (Ctrl-C stops it)"
    assert f"http://127.0.0.1:{port}/" in printed, printed + proc.stdout.read() if proc.poll() is not None else printed
    token = printed.split("?token=")[1].split()[0] if "?token=" in printed else None
    deadline = time.time() + 60  # for a hang: the app is up in a second or two here
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "no start"
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}", token


@pytest.fixture(scope="module")
def launched(finished_run, second_run, endpoints, tmp_path_factory):
    """`gpuwise ui` as a user starts it: with the endpoints' key and no key of its own, so with a token."""
    env = dict(os.environ, GPUWISE_DB=str(finished_run.parents[1] / "runs.sqlite"), GPUWISE_ENDPOINT_KEY="k")
    env.pop("GPUWISE_API_KEY", None)
    args = ["--runs-dir", str(finished_run.parent)]
    args += ["--endpoint", endpoints[0][0], "--endpoint", endpoints[1][0] + "/v1"]  # the OpenAI base URL too
    proc, url, token = launch_ui(*args, env=env)
    assert token is not None, "a ui holding an endpoint key and no key of its own printed no token"
    yield url, token
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def server(launched) -> str:
    return launched[0]


@pytest.fixture(scope="module")
def page(launched):
    """A Chromium tab that opened the URL `gpuwise ui` printed, as a user does: its token became the key cookie,
    and left the address bar."""
    url, token = launched
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/?page=plan&token={token}")
        assert page.url == f"{url}/?page=plan"  # the token left the address bar (and the history)
        cookie = next(c for c in page.context.cookies() if c["name"] == "gpuwise_key")
        assert cookie["value"] == token and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        yield page
        browser.close()


# Every text of every chart inside its chart: a legend, a label or a figure cut at the edge is not read.
TEXTS_INSIDE = """(sel) => [...document.querySelectorAll(sel)].flatMap((svg) => {
  const box = svg.getBoundingClientRect();
  return [...svg.querySelectorAll('text')].filter((t) => {
    const b = t.getBoundingClientRect();  // as drawn: a rotated axis label too
    return b.left < box.left - 0.5 || b.right > box.right + 0.5;
  }).map((t) => `'${t.textContent}' in '${svg.getAttribute('aria-label')}'`);
})"""
# Each column's header aligned as its cells are.
HEADERS_ALIGNED = """(sel) => [...document.querySelectorAll(sel)].flatMap((table) => {
  const row = table.querySelector('tbody tr');
  return [...table.querySelectorAll('thead th')].map((th, i) => [th.textContent, getComputedStyle(th).textAlign,
    row && row.children[i] ? getComputedStyle(row.children[i]).textAlign : null])
    .filter(([, a, b]) => b !== null && a !== b);
})"""


def shot(page, name: str, tmp_path: Path) -> None:
    for where in [tmp_path] + ([SHOTS] if SHOTS else []):
        where.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(where / name), full_page=True)
    assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.slow
def test_a_person_plans_a_model_in_the_browser(server, page, capsys, tmp_path):
    page.goto(f"{server}/?page=plan&model=llama-3.1-8b&task=qlora")
    page.wait_for_selector("#sweep tbody tr")
    expected = cli_plan(capsys, "--model", "llama-3.1-8b", "--task", "qlora")
    summary = page.inner_text("#plansummary")
    assert expected["gpu_name"] in summary and expected["why"] in summary
    assert page.locator("#sweep tbody tr").count() == len(expected["options"])
    assert page.locator("#sweep .cheapest").count() == 1 and page.locator("#sweep .fastest").count() == 1
    assert page.locator("svg[aria-label='memory per GPU'] rect").count() >= 3
    shot(page, "ui-plan.png", tmp_path)
    # the answer follows the inputs, and the URL holds them
    eight = cli_plan(capsys, "--model", "llama-3.1-8b", "--task", "qlora", "--batch", "8")
    assert eight["why"] != expected["why"]
    page.fill("input[name=batch]", "8")
    page.wait_for_function("location.search.includes('batch=8')")
    shows = "([s, why]) => document.querySelector(s)?.innerText.includes(why)"
    page.wait_for_function(shows, arg=["#plansummary", eight["why"]])
    # an impossible combination: the CLI's line beside the field, no blank page, no trace
    page.fill("input[name=tp]", "3")
    page.wait_for_selector(".err[data-for=tp]:not(:empty)")
    # in the form's words: the field's label where the CLI names its flag
    assert "Tensor parallel 3 must divide llama-3.1-8b's 32 attention heads" in page.inner_text(".err[data-for=tp]")
    page.fill("input[name=tp]", "")
    page.wait_for_selector("#sweep tbody tr")
    # the fields the assumptions name: an efficiency of one's own is the plan's, as --efficiency is the CLI's
    page.fill("input[name=efficiency]", "0.3")
    page.wait_for_function("location.search.includes('efficiency=0.3')")
    page.wait_for_function(shows, arg=["#assumptions", "efficiency = 0.3: --efficiency"])
    page.fill("input[name=efficiency]", "")
    # sorting by a column, from the keyboard
    page.focus("#sweep th[data-sort='4']")
    page.keyboard.press("Enter")
    assert page.get_attribute("#sweep th[data-sort='4']", "aria-sort") == "ascending"


@pytest.mark.slow
def test_a_person_plans_serving_for_a_traffic_in_the_browser(server, page, capsys, tmp_path):
    page.goto(f"{server}/?page=plan&{SERVE_QUERY}")
    page.wait_for_selector("#servetable tbody tr")
    assert page.is_hidden("input[name=batch]") and page.is_visible("input[name=rps]")
    expected = cli_plan(capsys, *query_flags(SERVE_QUERY))
    best = expected["options"][0]
    assert best["cheapest"]
    summary = page.inner_text("#plansummary")
    assert f"{best['gpus']} x {best['gpu_name']}" in summary and "TTFT ≤ 1.00 s" in summary
    # latency against load, the target drawn across: one chart for TTFT, one for TPOT, the CLI's curve in each
    charts = page.locator("#servecharts svg")
    assert charts.count() == 2
    assert page.locator("#servecharts line.target").count() == 2 and page.locator("#servecharts line.knee").count() == 2
    drawn = [p for p in best["curve"] if p["ttft_p95"] is not None]
    assert charts.nth(0).locator("circle").count() == len(drawn)
    # the target line sits at the target: 1 s on the TTFT chart's scale, which its circles share
    ttft_chart = charts.nth(0)
    target_y = float(ttft_chart.locator("line.target").get_attribute("y1"))
    ys = [float(c.get_attribute("cy")) for c in ttft_chart.locator("circle").all()]
    below = [y for y, p in zip(ys, drawn, strict=True) if p["ttft_p95"] < 1.0]
    above = [y for y, p in zip(ys, drawn, strict=True) if p["ttft_p95"] > 1.0]
    assert all(y > target_y for y in below) and all(y < target_y for y in above)  # SVG's y grows downwards
    assert page.locator("#hosted tbody tr").count() == len(expected["hosted"]) + len(expected["closed"])
    shot(page, "ui-serve.png", tmp_path)
    # the traffic follows the inputs, and the URL holds them
    page.fill("input[name=rps]", "30")
    page.wait_for_function("location.search.includes('rps=30')")
    more = cli_plan(capsys, *query_flags(SERVE_QUERY.replace("rps=3", "rps=30")))
    shows = "([s, text]) => document.querySelector(s)?.innerText.includes(text)"
    page.wait_for_function(shows, arg=["#plansummary", f"{more['options'][0]['gpus']} x {best['gpu_name']}"])
    # bad traffic: the CLI's line beside its field
    page.fill("input[name=rps]", "-2")
    page.wait_for_selector(".err[data-for=rps]:not(:empty)")
    assert "Requests/s at the busy hour must be above 0" in page.inner_text(".err[data-for=rps]")
    # back to a training task: its own fields again
    page.select_option("select[name=task]", "qlora")
    page.wait_for_selector("#sweep tbody tr")
    assert page.is_visible("input[name=batch]") and page.is_hidden("input[name=rps]")


@pytest.mark.slow
def test_a_person_opens_a_run_and_finds_its_curves(server, page, tmp_path):
    page.goto(f"{server}/?page=runs")
    page.wait_for_selector("#runstable tbody tr")
    page.click("#runstable a")
    page.wait_for_selector("#curves svg")
    assert page.locator("#curves svg[aria-label=loss]").count() == 1
    assert "peak memory" in page.inner_text("#planactual")
    shot(page, "ui-run.png", tmp_path)


@pytest.mark.slow
def test_a_person_sets_two_runs_side_by_side(server, page, tmp_path):
    page.goto(f"{server}/?page=runs")
    page.wait_for_selector("#runstable tbody tr")
    assert page.is_disabled("#comparebtn")
    assert page.locator("#runstable .pick").count() == 2  # both recorded: keyed by their record ids
    for n in range(2):
        page.locator("#runstable .pick").nth(n).check()
    page.click("#comparebtn")
    page.wait_for_selector("#comparecurves svg")
    loss = page.locator("#comparecurves svg[aria-label=loss] path[data-series]")
    assert loss.count() == 2  # one line per run on the same axes
    assert "lr" in page.inner_text("#configdiff") and "max_steps" in page.inner_text("#configdiff")
    assert "accuracy" in page.inner_text("#comparetable")
    assert page.evaluate(TEXTS_INSIDE, "#comparecurves svg") == []  # the legends too
    shot(page, "ui-compare.png", tmp_path)


@pytest.mark.slow
def test_a_person_chats_with_a_served_model_and_drops_an_image_on_another(
    server, page, endpoints, finished_run, tmp_path
):
    page.goto(f"{server}/?page=models")
    page.wait_for_selector("#endpoints tbody tr")
    assert page.locator("#servable td", has_text="gpuwise serve").count() >= 2  # the two runs
    assert page.evaluate(HEADERS_ALIGNED, "#servable, #endpoints") == []
    # a chat reply streams in, the same text as the endpoint's own greedy answer
    ask = {
        "model": "product-lm",
        "messages": [{"role": "user", "content": "my dog"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    expected = endpoints[1][2].post("/v1/chat/completions", json=ask).json()["choices"][0]["message"]["content"]
    page.fill("#temperature", "0")
    page.fill("#maxtokens", "8")
    page.fill("#chatinput", "my dog")
    page.keyboard.press("Enter")
    page.wait_for_selector("#chatstats:has-text('tokens in')")
    assert page.text_content(".msg.assistant .text") == expected
    assert "finish: length" in page.inner_text("#chatstats") or "finish: stop" in page.inner_text("#chatstats")
    # an image sent from the file chooser of the drop zone: the endpoint's probability, shown
    png = next((finished_run.parents[1] / "cells" / "defective").iterdir())
    direct = endpoints[0][2].post("/v1/predict", files={"file": (png.name, png.read_bytes(), "image/png")}).json()
    page.set_input_files("#imagefile", str(png))
    page.wait_for_selector("#prediction")
    assert f"probability {direct['predictions'][0]['probability']:.3f}" in page.inner_text("#prediction")
    shot(page, "ui-models.png", tmp_path)


@pytest.mark.slow
def test_a_tab_without_the_token_is_asked_for_it_and_works_once_given(launched, page):
    url, token = launched
    fresh = page.context.browser.new_page()  # a context of its own: no cookie from the printed URL
    try:
        fresh.goto(f"{url}/?page=runs")
        fresh.wait_for_selector("#keybox:not([hidden])")
        assert "open the URL gpuwise ui printed" in fresh.inner_text("#runsout")
        assert fresh.locator("#runstable").count() == 0  # nothing of the record without it
        fresh.fill("#key", token)
        fresh.press("#key", "Tab")  # committed: the page keeps it and asks again
        fresh.wait_for_selector("#runstable tbody tr")
    finally:
        fresh.close()


@pytest.mark.slow
def test_the_bench_page_shows_every_figure_and_says_why_one_is_above_100_percent(server, page, finished_run):
    """A CPU's boost runs above the clock its peak counts: the bar's figure, 141 %, is shown whole beside it, and
    the caption says why; the peak's long derivation goes under the chart, not off its edge (issue #50)."""
    from test_results import BENCH

    from gpuwise.runs import db

    boosted = json.loads(json.dumps(BENCH))
    boosted["devices"]["cpu"]["matmul"]["fp32"]["fraction_of_peak"] = 1.41
    db.record("bench", "cpu:AMD EPYC", "bench", boosted, path=finished_run.parents[1] / "runs.sqlite")  # the ui's
    page.goto(f"{server}/?page=bench")
    page.wait_for_selector("#benchout svg")
    assert "141 %" in page.text_content("#benchout svg >> nth=0")
    caption = page.inner_text("#benchout figcaption >> nth=0")
    assert "2 cores x 32 FP32 FLOP/cycle" in caption and "above 100 %" in caption
    assert page.evaluate(TEXTS_INSIDE, "#benchout svg") == []


def test_the_fleet_page_charts_the_hours_and_the_measured_use_of_the_record(server, page, finished_run, tmp_path):
    """Issue #53: the Fleet page draws what `gpuwise fleet --json` gives for the ui's record (the two defects runs,
    each measured while it trained): its device-hours by group over time, the measured hours by utilization, and
    the groups' table; every chart's text inside its chart."""
    page.goto(f"{server}/?page=fleet&since=1d&by=workload")
    page.wait_for_selector("#fleettable")
    charts = page.locator("#fleetout svg")
    assert charts.count() == 2
    assert "by workload, per hour" in charts.nth(0).get_attribute("aria-label")  # core-seconds: short runs
    assert "by utilization" in charts.nth(1).get_attribute("aria-label")
    rows = page.inner_text("#fleettable tbody")
    assert "defects" in rows and page.locator("#fleettable tbody tr").count() == 1
    assert page.evaluate(TEXTS_INSIDE, "#fleetout svg") == []
    assert page.evaluate(HEADERS_ALIGNED, "#fleettable") == []
    page.select_option("#fby", "user")  # the form asks again, and the address says what is shown
    page.wait_for_function("document.querySelector('#fleettable thead th').textContent === 'user'")
    assert "by=user" in page.url
    shot(page, "ui-fleet.png", tmp_path)


def test_the_fleet_api_refuses_a_bad_span_in_one_line(finished_run):
    answer = client(runs_dir=finished_run.parent).get("/api/fleet", params={"since": "forever"})
    assert answer.status_code == 400 and "give a span such as 90s" in answer.json()["error"]
