"""`gpuwise ui`: its API answers what the CLI answers (the plan page and `gpuwise plan --json` agree), bad
input is a 400 with the CLI's one line and its field, the API key rule of `serve`; and a real headless
Chromium (Debian's `chromium`, driven by Playwright) fills the plan form, reads the answer and the error
beside a field, opens a real run's page and finds its curves, and saves screenshots."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpuwise.cli import main
from gpuwise.ui.app import create_app

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
    got = TestClient(create_app()).get(f"/api/plan?{query}")
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
    got = TestClient(create_app()).get(f"/api/plan?{query}")
    assert got.status_code == 400
    assert got.json()["field"] == field and message in got.json()["error"]
    if "must divide" in message or "must be at least" in message:  # the planner's own checks: the CLI's words
        flags = [x for p in query.split("&") for x in (f"--{p.split('=')[0]}", p.split("=")[1])]
        assert main(["plan", *flags]) == 2
        assert got.json()["error"] in capsys.readouterr().err


def test_a_non_model_file_is_refused_in_one_line(tmp_path):
    junk = tmp_path / "photo.gguf"
    junk.write_bytes(b"\x89PNG not a model")
    got = TestClient(create_app()).get(f"/api/plan?model={junk}")
    assert got.status_code == 400 and got.json()["field"] == "model" and "\n" not in got.json()["error"]


def test_the_runs_api_lists_a_finished_run_with_its_curves_and_planned_beside_measured(finished_run):
    client = TestClient(create_app(runs_dir=finished_run.parent))
    rows = client.get("/api/runs").json()
    assert [(r["key"], r["status"], r["workload"]) for r in rows] == [("defects-tiny", "finished", "defects")]
    assert client.get("/api/runs?status=running").json() == []
    run = client.get("/api/runs/defects-tiny").json()
    assert [p[0] for p in run["curves"]["loss"]] == list(range(1, 7))
    assert run["summary"]["actual"]["peak_bytes"] > 0 and run["config"]["max_steps"] == 6
    assert client.get("/runs/defects-tiny/report").text.startswith("<!doctype html>")
    for bad in ("..", "nope", "999"):
        assert client.get(f"/api/runs/{bad}").status_code in (400, 404)


def test_with_a_key_every_data_path_needs_it_and_the_page_does_not(finished_run):
    client = TestClient(create_app(runs_dir=finished_run.parent, key="s3cret"))
    assert client.get("/").status_code == 200 and client.get("/static/app.js").status_code == 200
    assert client.get("/api/plan?model=llama-3.1-8b").status_code == 401
    assert client.get("/runs/defects-tiny/report").status_code == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/api/plan?model=llama-3.1-8b", headers=ok).status_code == 200
    client.cookies.set("gpuwise_key", "s3cret")  # what the page sets for its links
    assert client.get("/runs/defects-tiny/report").status_code == 200


def test_off_loopback_without_a_key_is_refused(capsys):
    assert main(["ui", "--host", "0.0.0.0"]) == 2
    assert "set --api-key" in capsys.readouterr().err


# --- in a real browser ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(finished_run, tmp_path_factory):
    port = free_port()
    env = dict(os.environ, GPUWISE_DB=str(finished_run.parents[1] / "runs.sqlite"))
    cmd = [sys.executable, "-m", "gpuwise", "ui", "--port", str(port), "--runs-dir", str(finished_run.parent)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def page():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        yield page
        browser.close()


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
    assert "--tp 3 must divide llama-3.1-8b's 32 attention heads" in page.inner_text(".err[data-for=tp]")
    page.fill("input[name=tp]", "")
    page.wait_for_selector("#sweep tbody tr")
    # sorting by a column, from the keyboard
    page.focus("#sweep th[data-sort='4']")
    page.keyboard.press("Enter")
    assert page.get_attribute("#sweep th[data-sort='4']", "aria-sort") == "ascending"


@pytest.mark.slow
def test_a_person_opens_a_run_and_finds_its_curves(server, page, tmp_path):
    page.goto(f"{server}/?page=runs")
    page.wait_for_selector("#runstable tbody tr")
    page.click("#runstable a")
    page.wait_for_selector("#curves svg")
    assert page.locator("#curves svg[aria-label=loss]").count() == 1
    assert "peak memory" in page.inner_text("#planactual")
    shot(page, "ui-run.png", tmp_path)
