"""`gpuwise export --format onnx`: the ONNX graph gives torch's outputs for any batch size, the command
reports how close they are, and every bad request is one line and exit code 2."""

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.serve.export import export_onnx, load_torch, onnx_forward
from gpuwise.workloads.defects import read_image, to_tensor

from train_data import image_folder, interactions_csv

TOL = 1e-4  # absolute; float32 kernels differ in summation order only (measured ~1e-6)


def train(root: Path, args: str) -> Path:
    run = root / "run"
    with pytest.MonkeyPatch.context() as mp:  # the per-test GPUWISE_DB is not set yet at module scope
        mp.setenv("GPUWISE_DB", str(root / "runs.sqlite"))
        assert main([*args.split(), "--run-dir", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return image_folder(tmp_path_factory.mktemp("cells"), per_class=8, size=32)


def defects(tmp_path_factory, cells, model: str) -> Path:
    root = tmp_path_factory.mktemp("defects")
    run = train(root, f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 2 --model {model}")
    export_onnx(run)
    return run


@pytest.fixture(scope="module")
def defects_run(tmp_path_factory, cells):
    return defects(tmp_path_factory, cells, "cnn")


@pytest.fixture(scope="module")
def multiscale_run(tmp_path_factory, cells):
    return defects(tmp_path_factory, cells, "multiscale")  # CNNs at 32 and 48 px, input 48


@pytest.fixture(scope="module", params=["sasrec", "mf"])
def recommender_run(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("recommender")
    data = interactions_csv(root / "interactions.csv")
    run = train(root, f"train recommender --data {data} --batch-size 8 --max-steps 3 --model {request.param}")
    export_onnx(run)
    return run


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape and a.dtype == np.float32
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("which", ["defects_run", "multiscale_run"])
def test_defects_onnx_matches_torch_at_every_batch_size(which, cells, request):
    defects_run = request.getfixturevalue(which)
    model = load_torch(defects_run)[2]
    size = json.loads((defects_run / "labels.json").read_text())["image_size"]
    files = sorted(cells.rglob("*.png"))[::3]  # both class folders
    x = to_tensor(np.stack([read_image(f, size) for f in files]))
    forward = onnx_forward(defects_run / "model.onnx")
    graph = onnx.load(str(defects_run / "model.onnx")).graph
    assert [i.name for i in graph.input] == ["images"] and [o.name for o in graph.output] == ["logits"]
    for batch in (x, x[:1], x[1:6]):
        with torch.no_grad():
            expected = model(batch).numpy()
        got = forward(batch.numpy())
        assert got.shape == (len(batch),)
        assert max_diff(got, expected) < TOL


def test_recommender_onnx_matches_torch_at_every_batch_size(recommender_run):
    model = load_torch(recommender_run)[2]  # users -> every item's score, as exported (the history rides along)
    n_items = len(json.loads((recommender_run / "ids.json").read_text())["items"])
    forward = onnx_forward(recommender_run / "model.onnx")
    for users in (np.arange(0, 40, 3), np.array([7]), np.array([39, 0, 5, 5, 12])):
        with torch.no_grad():
            expected = model(torch.from_numpy(users)).numpy()
        got = forward(users)
        assert got.shape == (len(users), n_items)
        assert max_diff(got, expected) < TOL


def test_export_command_reports_the_file_and_the_difference(recommender_run, capsys):
    assert main(["export", str(recommender_run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    path = Path(out["path"])
    assert path == recommender_run / "model.onnx"
    assert out["bytes"] == path.stat().st_size > 0
    assert out["inputs"] == 8 and 0 <= out["max_abs_diff"] < TOL
    assert not [p for p in recommender_run.iterdir() if p.name.endswith(".tmp")]

    assert main(["export", str(recommender_run)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"wrote {path} (") and "onnxruntime vs torch on 8 inputs" in line


def test_a_failed_export_leaves_the_old_file_and_no_temp(defects_run, monkeypatch):
    before = (defects_run / "model.onnx").read_bytes()

    def broken(_):
        raise onnx.checker.ValidationError("boom")

    monkeypatch.setattr(onnx.checker, "check_model", broken)
    with pytest.raises(GpuwiseError, match="ONNX export failed"):
        export_onnx(defects_run)
    assert (defects_run / "model.onnx").read_bytes() == before
    assert not [p for p in defects_run.iterdir() if p.name.endswith(".tmp")]


def bad_runs(root: Path, defects_run: Path) -> dict:
    (root / "lm").mkdir()
    (root / "lm" / "config.yaml").write_text("workload: product-lm\n")
    unfinished = root / "unfinished"
    shutil.copytree(defects_run, unfinished)
    (unfinished / "summary.json").unlink()
    no_weights = root / "no-weights"
    shutil.copytree(defects_run, no_weights)
    (no_weights / "model.safetensors").unlink()
    edited = root / "edited"
    shutil.copytree(defects_run, edited)
    labels = json.loads((edited / "labels.json").read_text())
    (edited / "labels.json").write_text(json.dumps(labels | {"pool": "max"}))
    return {
        "product-lm": ([str(root / "lm")], "does not apply to product-lm: it serves through torch"),
        "unfinished": ([str(unfinished)], "has not finished training (no summary.json)"),
        "no weights": ([str(no_weights)], "no model.safetensors"),
        "not a run": ([str(root / "nowhere")], "not a gpuwise run directory"),
        "tflite": ([str(defects_run), "--format", "tflite"], "--format tflite: only onnx"),
        "edited labels": ([str(edited)], "pool 'max' and views 8; this version reads pool 'gem' or 'avg'"),
    }


@pytest.mark.parametrize("case", ["product-lm", "unfinished", "no weights", "not a run", "tflite", "edited labels"])
def test_bad_requests_are_one_line_and_exit_2(case, defects_run, tmp_path, capsys):
    args, message = bad_runs(tmp_path, defects_run)[case]
    assert main(["export", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("gpuwise: error: ") and message in line


@pytest.mark.parametrize("content", [b"not a protobuf", None])
def test_onnx_forward_on_a_bad_file_says_how_to_make_one(content, tmp_path):
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(GpuwiseError) as e:
        onnx_forward(path)
    (line,) = str(e.value).splitlines()
    assert "not a readable ONNX model" in line and f"gpuwise export {tmp_path} --format onnx" in line
