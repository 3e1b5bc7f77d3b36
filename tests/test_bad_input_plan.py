"""Bad input to plan, hardware, runs, report and bench: one line on stderr and exit 2, never a traceback,
never a hang on a device file, never nonsense accepted; and --json is standard JSON whatever the figures."""

import json
import os
import sqlite3
import sys

import pytest

from gpuwise.cli import main

M = ["plan", "--model", "llama-3.1-8b"]
TINY = "layers=2,hidden=64,heads=4,ffn=128,vocab=100"
POSIX = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and /dev are POSIX")


def one_line_error(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert err.startswith("gpuwise: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    return err


def strict_json(text: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "argv,needle",
    [
        # Non-finite and out-of-range numbers, each named with its range.
        (M + ["--tokens", "inf"], "--tokens must be at least 1 and at most 1e+16"),
        (M + ["--tokens", "nan"], "(tokens in the whole job), not nan"),
        (M + ["--task", "finetune", "--tokens", "1e-320"], "--tokens must be at least 1"),
        (M + ["--task", "finetune", "--dataset-tokens", "inf"], "--dataset-tokens must be"),
        (M + ["--task", "finetune", "--dataset-tokens", "1e6", "--epochs", "inf"], "--epochs must be"),
        (M + ["--task", "finetune", "--dataset-tokens", "1e6", "--epochs", "0"], "--epochs must be"),
        (M + ["--efficiency", "nan"], "--efficiency must be at least 0.001 and at most 1"),
        (M + ["--efficiency", "1e-300"], "--efficiency must be"),
        (M + ["--utilization", "nan"], "--utilization must be"),
        (M + ["--utilization", "1e-300"], "--utilization must be"),
        (M + ["--life-years", "inf"], "--life-years must be"),
        (M + ["--life-years", "0"], "--life-years must be"),
        (M + ["--kwh-usd", "inf"], "--kwh-usd must be"),
        (M + ["--kwh-usd", "-0.1"], "--kwh-usd must be at least 0"),
        (M + ["--pue", "nan"], "--pue must be at least 1"),
        (M + ["--pue", "0.5"], "--pue must be at least 1"),
        (M + ["--batch", str(10**15)], "--batch must be at least 1 and at most 1,000,000"),
        (M + ["--batch", str(10**400)], "(401 digits)"),
        (M + ["--seq", "0"], "--seq must be at least 1"),
        (M + ["--gen", "-1"], "--gen must be at least 0"),
        (M + ["--gpus", str(10**12)], "--gpus must be at least 1 and at most 1,000,000"),
        (M + ["--gpus", "0"], "--gpus must be at least 1"),
        (M + ["--tp", "0"], "--tp must be at least 1"),
        (M + ["--pp", "0"], "--pp must be at least 1"),
        (M + ["--pp", "33"], "more pipeline stages than llama-3.1-8b's 32 layers"),
        (M + ["--task", "finetune", "--zero", "4"], "--zero must be at least 0 and at most 3"),
        (M + ["--task", "lora", "--lora-rank", "0"], "--lora-rank must be at least 1"),
        (M + ["--task", "lora", "--lora-rank", "8192"], "wider than llama-3.1-8b's hidden size"),
        (M + ["--tokens", "abc"], "Invalid value for '--tokens'"),
        # Names: empty, unknown.
        (M + ["--gpu", ""], "--gpu is empty"),
        (M + ["--gpu", "nonsense"], "unknown accelerator 'nonsense'"),
        (M + ["--provider", " "], "--provider is empty"),
        (["hardware", "nosuchslug"], "unknown accelerator 'nosuchslug'"),
        (["hardware", ""], "an empty accelerator name"),
        (["plan", "--model", ""], "--model is empty"),
        (["plan", "--model", "~no_such_user_gpuwise/config.json"], "no such user's home directory"),
        (["plan", "--model", "a" * 5000], "(5000 characters): File name too long"),
        # Explicit dimensions.
        (["plan", "--model", "layers=0,hidden=64,heads=4,ffn=128,vocab=100"], "'layers' must be a whole number"),
        (["plan", "--model", "layers=abc,hidden=64,heads=4,ffn=128,vocab=100"], "not 'abc'"),
        (["plan", "--model", "layers=2,hidden=1e400,heads=4,ffn=128,vocab=100"], "'hidden' must be a whole number"),
        (["plan", "--model", f"layers={10**30},hidden=64,heads=4,ffn=128,vocab=100"], "from 1 to 10,000"),
        (["plan", "--model", "layers=2,hidden=64,heads=3,ffn=128,vocab=100"], "heads 3 does not divide hidden 64"),
        (["plan", "--model", TINY + ",kv_heads=3"], "must be a multiple of kv_heads (3)"),
        (["plan", "--model", TINY + ",max_seq=-1"], "'max_seq' must be a whole number"),
        (["plan", "--model", "layers=2,,hidden=64"], "a part names no dimension"),
        # --traced: refused before a model is built when it could never finish or torch could not count it.
        (["plan", "--traced", "--gpu", "h100-sxm", "--task", "finetune", "--model", TINY.replace("2", "300", 1)],
         "the most it traces is 256"),
        (["plan", "--traced", "--gpu", "h100-sxm", "--task", "finetune", "--model", TINY,
          "--batch", "1000000", "--seq", "10000000"], "more than torch can count"),
        (["plan", "--traced", "--gpu", "h100-sxm", "--task", "finetune", "--workload", "defects", "--gpus", "5000"],
         "at most 4096 --gpus"),
        (["plan", "--traced", "--gpu", "h100-sxm", "--task", "finetune", "--module", "json:loads"],
         "tracing json:loads failed: TypeError"),
    ],
)
def test_bad_flags(capsys, argv, needle):
    assert needle in one_line_error(capsys, argv)


LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_hidden_layers": "32"}, "'num_hidden_layers' must be a whole number from 1 to 10,000, not '32'"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a whole number"),
        ({"num_hidden_layers": 2.5}, "not 2.5"),
        ({"num_hidden_layers": 1e30}, "not 1e+30"),
        ({"num_hidden_layers": -4}, "not -4"),
        ({"hidden_size": True}, "'hidden_size' must be a whole number"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads 3 does not divide hidden_size"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be a whole number"),
        ({"num_key_value_heads": -8}, "'num_key_value_heads' must be a whole number"),
        ({"max_position_embeddings": -1}, "'max_position_embeddings' must be a whole number"),
        ({"max_position_embeddings": 0}, "'max_position_embeddings' must be a whole number"),
        ({"head_dim": 0.5}, "'head_dim' must be a whole number"),
        ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
        ({"model_type": 5}, "model_type '5' is not supported"),
    ],
)
def test_bad_config_json_values(capsys, tmp_path, change, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA | change))
    assert needle in one_line_error(capsys, ["plan", "--model", cfg])


def test_a_whole_float_and_an_odd_name_still_plan(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA | {"num_hidden_layers": 32.0, "_name_or_path": [1, 2]}))
    assert main(["plan", "--model", str(cfg), "--gpu", "h100-sxm", "--json"]) == 0
    res = strict_json(capsys.readouterr().out)
    assert res["model"]["name"] == tmp_path.name and res["fits"]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[1, 2, 3]", "a config.json holds one JSON object"),
        ("[" * 100_000, "nested too deep"),
        ('{"model_type": "llama",', "not valid JSON"),
    ],
)
def test_config_json_that_is_not_an_object(capsys, tmp_path, text, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(text)
    assert needle in one_line_error(capsys, ["plan", "--model", cfg])


def _odd_files(tmp_path):
    """(path, what the refusal says) for each kind of file that is not a small text file."""
    huge = tmp_path / "huge.csv"
    with open(huge, "wb") as f:
        f.truncate(11 * 2**20)  # sparse: 11 MiB of zeros without writing them
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe\x00binary")
    nul = tmp_path / "nul.csv"
    nul.write_bytes(b"slug,name\x00\n")
    (tmp_path / "adir").mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: opening it for reading the usual way would block for ever
    return [(huge, "over 10 MiB"), (binary, "not a UTF-8 text file"), (nul, "not a UTF-8 text file"),
            (tmp_path / "adir", "it is a directory"), ("/dev/zero", "not a regular file"),
            ("/dev/urandom", "not a regular file"), (fifo, "not a regular file")]


@POSIX
def test_catalog_and_config_files_that_are_not_text(capsys, tmp_path, monkeypatch):
    for path, needle in _odd_files(tmp_path):
        assert needle in one_line_error(capsys, ["hardware", "--catalog", path]), path
        assert needle in one_line_error(capsys, ["plan", "--model", "llama-3.1-8b", "--catalog", path]), path
        monkeypatch.setenv("GPUWISE_CATALOG", str(path))
        assert needle in one_line_error(capsys, ["devices"]), path
        monkeypatch.delenv("GPUWISE_CATALOG")
        if not os.path.isdir(path):  # a directory is a model folder: its config.json is looked up, below
            assert needle in one_line_error(capsys, ["plan", "--model", path]), path
    (tmp_path / "model" / "config.json").mkdir(parents=True)
    assert "it is a directory" in one_line_error(capsys, ["plan", "--model", tmp_path / "model"])


ACC_HEADER = (
    "slug,name,vendor,kind,mem_gb,mem_bw_gbs,fp32_tflops,tf32_tflops,bf16_tflops,fp16_tflops,fp8_tflops,"
    "int8_tops,tdp_w,interconnect,nvlink_domain,max_per_node,launch_year,device_names,source,as_of"
)


def _acc_row(mem="80", bw="2000", names="My GPU"):
    return f"my-gpu,My GPU,acme,gpu,{mem},{bw},10,20,100,100,,,300,PCIe,1,8,2025,{names},src,2025-01"


@pytest.mark.parametrize(
    "body,needle",
    [
        (f"{ACC_HEADER}\n{_acc_row(mem='inf')}\n", "field 'mem_gb': 'inf' is not a finite number"),
        (f"{ACC_HEADER}\n{_acc_row(mem='nan')}\n", "field 'mem_gb': 'nan' is not a finite number"),
        (f"{ACC_HEADER}\n{_acc_row(mem='0')}\n", "field 'mem_gb': '0' must be between 0.001 and 100000"),
        (f"{ACC_HEADER}\n{_acc_row(bw='0')}\n", "field 'mem_bw_gbs': '0' must be between 0.001"),
        (f"{ACC_HEADER}\n{_acc_row(bw='2e12')}\n", "field 'mem_bw_gbs': '2e12' must be between"),
        (f"{ACC_HEADER}\n{_acc_row(names='My(GPU')}\n", "field 'device_names': 'My(GPU' is not a regular expression"),
        ("slug,provider,usd_per_gpu_hour,kind,as_of,source\nh100-sxm,X,inf,k,2026,s\n", "is not a finite number"),
        ("slug,provider,usd_per_gpu_hour,kind,as_of,source\nh100-sxm,X,1e300,k,2026,s\n", "must be between 0 and"),
        (f'{ACC_HEADER}\n"{"x" * 200_000}"\n', "not a readable CSV (field larger than field limit"),
    ],
)
def test_catalog_values(capsys, tmp_path, body, needle):
    f = tmp_path / "mine.csv"
    f.write_text(body)
    assert needle in one_line_error(capsys, ["plan", "--model", "llama-3.1-8b", "--catalog", f])


def _corrupt_dbs(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not an SQLite file " * 100)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE records (x INTEGER)")
    con.close()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # SQLite would wait on it for ever
    return [(tmp_path, "it is a directory"), (garbage, "file is not a database"),
            (other, "is not a gpuwise run record"), ("/etc/passwd/x.sqlite", "Not a directory"),
            (fifo, "not a regular file"), ("/dev/zero", "not a regular file")]


@POSIX
def test_bad_run_record(capsys, tmp_path):
    for db, needle in _corrupt_dbs(tmp_path):
        assert needle in one_line_error(capsys, ["--db", db, "runs"]), db
        assert needle in one_line_error(capsys, ["--db", db, "runs", "show", "1"]), db
        assert needle in one_line_error(capsys, ["--db", db, "report", "--plan", "1"]), db
        # A plan does not need the record: it warns once, and answers.
        assert main(["--db", str(db), "plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--json"]) == 0, db
        out, err = capsys.readouterr()
        assert strict_json(out)["fits"] and err.count("\n") == 1 and err.startswith("gpuwise: warning: ")


def test_damaged_record_row(capsys, tmp_path):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--json"]) == 0
    record_id = json.loads(capsys.readouterr().out)["record_id"]
    with sqlite3.connect(os.environ["GPUWISE_DB"]) as con:
        con.execute("UPDATE records SET data = '{\"trunc' WHERE id = ?", (record_id,))
    con.close()
    assert "is damaged" in one_line_error(capsys, ["runs", "show", record_id])
    with sqlite3.connect(os.environ["GPUWISE_DB"]) as con:  # JSON, but not a plan's
        con.execute("UPDATE records SET data = '{\"options\": [{}]}' WHERE id = ?", (record_id,))
    con.close()
    assert "is damaged (no 'model')" in one_line_error(capsys, ["report", "--plan", record_id])


def test_unusable_calibration_is_neither_stored_nor_planned_with():
    from gpuwise.runs import db

    record_id = db.record("bench", "cuda:h100-sxm", "bench", {})
    db.calibrate("cuda:h100-sxm", {"matmul.bf16": float("nan"), "matmul.fp16": -0.5}, record_id)
    with sqlite3.connect(os.environ["GPUWISE_DB"]) as con:  # a hand-edited record
        con.execute("INSERT INTO calibration VALUES ('cuda:h100-sxm', 'matmul.fp8', 'abc', ?, 'now')", (record_id,))
    con.close()
    assert db.calibration_map() == {} and db.calibration("cuda:h100-sxm", "matmul.fp8") is None


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["runs", "show", "abc"], "Invalid value for 'record_id'"),
        (["runs", "show", "99"], "no record #99"),
        (["report", "--plan", "abc"], "Invalid value for '--plan'"),
        (["report", "--bench", "7"], "no record #7"),
        (["report", "/etc/passwd"], "not a directory"),
        (["bench", "--device", "cuda:abc"], "--device must be cpu, cuda:N or all"),
        (["bench", "--quick", "--device", "cpu", "--out", "/etc/passwd/x"], "--out /etc/passwd/x: cannot create"),
        (["bench", "--quick", "--device", "cpu", "--out", "/etc/passwd"], "a file of that name exists"),
    ],
)
def test_bad_record_ids_and_paths(capsys, argv, needle):
    assert needle in one_line_error(capsys, argv)


def test_report_out_that_cannot_be_written(capsys, tmp_path):
    assert main(["plan", "--model", "llama-3.1-8b", "--json"]) == 0
    record_id = json.loads(capsys.readouterr().out)["record_id"]
    # A directory of that name (under a file or without permission fails the same way, at the same place).
    assert "cannot write the report" in one_line_error(capsys, ["report", "--plan", record_id, "--out", tmp_path])


@pytest.mark.parametrize(
    "summary,metrics,needle",
    [
        (None, "", "not a finished gpuwise run (summary.json is missing)"),
        ('{"eval": {', "", "summary.json: not a JSON object"),
        ("[1, 2]", "", "summary.json: not a JSON object"),
        (b"\xff\xfe", "", "not a UTF-8 text file"),
        ('{"eval": {}}', "", "not what gpuwise train writes (no 'workload')"),
        ('{"eval": {}}', '{"step": 1, "loss": 2}\n{"step": 2, "lo', "metrics.jsonl:2: not a JSON object"),
        ('{"eval": {}}', "[1]\n", "metrics.jsonl:1: not a JSON object"),
    ],
)
def test_report_of_a_damaged_run(capsys, tmp_path, summary, metrics, needle):
    run = tmp_path / "run"
    run.mkdir()
    if isinstance(summary, bytes):
        (run / "summary.json").write_bytes(summary)
    elif summary is not None:
        (run / "summary.json").write_text(summary)
    (run / "metrics.jsonl").write_text(metrics)
    assert needle in one_line_error(capsys, ["report", run])


# --- JSON output ----------------------------------------------------------------------------------


def test_the_json_writer_turns_non_finite_numbers_into_null():
    from gpuwise.files import to_json

    text = to_json({"a": float("inf"), "b": [float("nan"), -float("inf"), 1.5], "c": (2,)})
    assert strict_json(text) == {"a": None, "b": [None, None, 1.5], "c": [2]}


def test_the_record_and_runs_show_hold_standard_json(capsys):
    from gpuwise.runs.db import record

    record_id = record("plan", "h100-sxm", "x", {"usd": float("inf")})
    assert main(["runs", "show", str(record_id)]) == 0
    assert strict_json(capsys.readouterr().out)["data"] == {"usd": None}


@pytest.mark.parametrize(
    "model,extra",
    [
        ("llama-3.1-8b", {"efficiency": 0.001, "tokens": 1e16, "utilization": 0.001, "life_years": 0.1}),
        ("llama-3.1-8b", {"kwh_usd": 0.0, "pue": 1.0, "utilization": 1.0}),
        ("llama-3.1-8b", {"kwh_usd": 10.0, "pue": 5.0, "gen": 0}),
        ("llama-3.1-405b", {"task": "pretrain", "tokens": 1e16, "efficiency": 0.001, "gpus": 1_000_000}),
        ("llama-3.1-8b", {"gpus": 1_000_000, "gpu": "h100-sxm", "batch": 1_000_000}),
        (TINY, {"task": "finetune", "dataset_tokens": 1.0, "epochs": 0.001}),
        (TINY, {"task": "lora", "lora_rank": 64, "seq": 10_000_000, "flash_attention": False}),
    ],
)
def test_extreme_but_valid_plans_have_only_finite_figures(catalog, model, extra):
    # Straight from the planner, not through the CLI's writer: a new inf or nan fails here, by name.
    from gpuwise.plan.model import resolve_model
    from gpuwise.plan.planner import make_plan
    from gpuwise.plan.request import PlanRequest

    result = make_plan(resolve_model(model), PlanRequest(**extra), catalog)
    json.dumps(result, allow_nan=False, default=str)


def test_serving_on_more_gpus_than_layers_adds_replicas_not_empty_stages(capsys):
    assert main(["plan", "--model", TINY, "--gpu", "h100-sxm", "--gpus", "64", "--json"]) == 0
    lay = strict_json(capsys.readouterr().out)["layout"]
    assert lay["pp"] <= 2 and lay["dp"] * lay["tp"] * lay["pp"] == 64 and lay["dp"] > 1


def test_plan_json_is_strict(capsys):
    assert main(M + ["--task", "qlora", "--kwh-usd", "0", "--json"]) == 0
    res = strict_json(capsys.readouterr().out)
    assert any(o["onprem"] for o in res["options"])


# --- the last line of defence ------------------------------------------------------------------------


def test_a_bug_is_one_line_with_exit_1_and_debug_shows_the_traceback(capsys, monkeypatch):
    import gpuwise.plan.planner

    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(gpuwise.plan.planner, "make_plan", broken)
    assert main(M) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (RuntimeError: boom)" in err
    monkeypatch.setenv("GPUWISE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(M)


def test_a_multi_line_message_is_printed_as_one(capsys, monkeypatch):
    import gpuwise.plan.planner
    from gpuwise.errors import GpuwiseError

    def refuse(*args, **kwargs):
        raise GpuwiseError("first\n  second\n")

    monkeypatch.setattr(gpuwise.plan.planner, "make_plan", refuse)
    assert one_line_error(capsys, M) == "gpuwise: error: first; second\n"
