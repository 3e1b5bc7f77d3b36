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
    # over one step since issue #16 ("torch.cuda.max_memory_allocated over one step")
    assert s["actual"]["method"].startswith("torch.cuda.max_memory_allocated") and s["mfu"]


def test_bf16_autocast_on_the_gpu_that_has_it(capsys, tmp_path):
    """On a GPU with native bf16 (Ampere and later) the run is bf16-mixed, its loss finite, its MFU counted
    against the catalog's 16-bit peak."""
    import torch

    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("no native bf16 before compute capability 8.0")
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps({"text": f"review {i}: good coffee, fresh beans"}) + "\n" for i in range(64)))
    args = f"train product-lm --base scratch --data {data} --block-size 32 --batch-size 8 --max-steps 4"
    assert main([*args.split(), "--run-dir", str(tmp_path / "r"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "bf16-mixed" and s["final_loss"] == s["final_loss"]  # not nan
    assert "16-bit" in s["peak_flops"]["origin"] and 0 < s["mfu"] < 1


def test_oom_back_off_on_the_real_allocator(capsys, tmp_path):
    """A process capped at 1 GiB of the GPU, a batch whose logits alone need 1 GiB: the real allocator's out
    of memory halves the micro-batch (probe or loop), the global batch is kept, the run finishes."""
    import numpy as np
    import torch

    # random words, so that the BPE vocabulary fills its 4,096: logits of 256 x 256 tokens x 4,096 in fp32 are
    # 1 GiB on their own
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 6)) for _ in range(5000)]
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 300))}) + "\n" for _ in range(256)))
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((1 << 30) / total)
    try:
        args = f"train product-lm --base scratch --data {data} --block-size 256 --batch-size 256 --max-steps 2"
        assert main([*args.split(), "--run-dir", str(tmp_path / "r"), "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert s["global_batch"] == 256 and s["micro_batch"] < 256 and s["accumulation"] > 1, s


def test_fsdp_on_one_gpu(capsys, tmp_path):
    cells = image_folder(tmp_path / "cells", per_class=16)
    args = f"train defects --data {cells} --image-size 32 --batch-size 8 --max-steps 4 --strategy fsdp"
    assert main([*args.split(), "--run-dir", str(tmp_path / "r"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["strategy"] == "fsdp" and s["device"].startswith("cuda") and s["actual"]["peak_bytes"] > 0


def test_nvml_sees_a_busy_gpu_busier_than_an_idle_one():
    """Issue #53: the NVML path of hardware/usage.py on a real GPU: SM utilization while a matmul loop runs is
    above the idle level, and memory used and power are read."""
    import time

    import torch

    from gpuwise.hardware.usage import Sampler, nvml_probe

    probe = nvml_probe([torch.cuda.current_device()])
    assert probe is not None and probe.kind == "cuda (NVML)" and probe.allocated_bytes > 0
    sampler = Sampler(probe, interval=3600)  # sampled by hand
    time.sleep(1.0)
    idle = sampler.sample()
    a = torch.randn(8192, 8192, device="cuda")
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        a @ a
    torch.cuda.synchronize()
    busy = sampler.sample()
    assert idle is not None and busy is not None and busy.utilization > idle.utilization and busy.utilization > 0.5
    assert busy.memory_bytes > idle.memory_bytes and (busy.power_w is None or busy.power_w > 0)
