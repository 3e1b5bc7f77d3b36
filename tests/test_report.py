"""`gpuwise report`: self-contained HTML with its plots inlined; the Pareto front is the right set."""

import json

from gpuwise.cli import main
from gpuwise.report.html import pareto_front

from train_data import image_folder


def test_pareto_front_keeps_only_undominated_options():
    pts = [{"hours": 1, "usd": 10}, {"hours": 2, "usd": 5}, {"hours": 3, "usd": 6}, {"hours": 0.5, "usd": 20},
           {"hours": 4, "usd": 1}]
    assert [(p["hours"], p["usd"]) for p in pareto_front(pts)] == [(0.5, 20), (1, 10), (2, 5), (4, 1)]


def test_run_and_plan_reports(capsys, tmp_path):
    cells = image_folder(tmp_path / "cells", per_class=8)
    run = tmp_path / "run"
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 3 --eval-every 1 --run-dir {run}"
    assert main(args.split()) == 0
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert page.startswith("<!doctype html>") and page.count("data:image/png;base64,") >= 4  # loss, speed, eval, plan
    assert "Quality on held-out data" in page and "majority class" in page
    capsys.readouterr()
    # --json: the figures the page draws, and where the page went
    assert main(["report", str(run), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["report"] == str(run / "report.html") and figures["kind"] == "run"
    assert figures["summary"]["steps"] == 3 and sum("loss" in r for r in figures["metrics"]) >= 3

    assert main(["plan", "--model", "llama-3.1-8b", "--task", "qlora", "--json"]) == 0
    plan_id = json.loads(capsys.readouterr().out)["record_id"]
    out = tmp_path / "plan.html"
    assert main(["report", "--plan", str(plan_id), "--out", str(out)]) == 0
    assert "Pareto front" in out.read_text()
    capsys.readouterr()
    assert main(["report", "--plan", str(plan_id), "--out", str(out), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["kind"] == "plan" and figures["record_id"] == plan_id and figures["task"] == "qlora"
    assert figures["front"] and all(p in figures["points"] for p in figures["front"])


def test_report_refusals_are_one_line(capsys, tmp_path):
    assert main(["report"]) == 2
    assert "exactly one of" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "not a finished gpuwise run" in capsys.readouterr().err
    assert main(["report", "--plan", "42"]) == 2
    assert "no record #42" in capsys.readouterr().err
