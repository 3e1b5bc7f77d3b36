"""On a CUDA machine: the same code path picks the GPU, mixed precision, and the catalog's peak."""

import json

import pytest

from gpuwise.cli import main

from train_data import image_folder

pytestmark = pytest.mark.gpu


def test_devices_matches_the_gpu_to_the_catalog(capsys):
    assert main(["devices", "--json"]) == 0
    dev = json.loads(capsys.readouterr().out)
    assert dev["cuda"] and dev["train_default"]["accelerator"] == "cuda"
    assert all(g["catalog_slug"] for g in dev["cuda"]), "a GPU the catalog does not know"


def test_train_picks_cuda_and_mixed_precision(capsys, tmp_path):
    cells = image_folder(tmp_path / "cells", per_class=16)
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 4 --run-dir {tmp_path / 'r'}"
    assert main([*args.split(), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["device"].startswith("cuda") and s["precision"] in ("bf16-mixed", "16-mixed")
    assert s["actual"]["method"] == "torch.cuda.max_memory_allocated" and s["mfu"]
