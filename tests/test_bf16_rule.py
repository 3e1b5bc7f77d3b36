"""One rule for bf16: native only (compute capability >= 8.0), for `gpuwise devices` and `gpuwise train`.

torch.cuda.is_bf16_supported() also counts emulation, so on a T4 or a V100 it says yes; both commands
must say no there, and pick 16-mixed, whatever torch answers."""

import json
from types import SimpleNamespace

import pytest
import torch

from gpuwise.cli import main
from gpuwise.hardware.devices import bf16_native, computes_bf16
from gpuwise.train.engine import resolve_precision

CARDS = {
    # capability: (torch's device name, native bf16, the precision both commands pick)
    (7, 5): ("Tesla T4", False, "16-mixed"),
    (8, 0): ("NVIDIA A100-SXM4-80GB", True, "bf16-mixed"),
}


@pytest.fixture(params=sorted(CARDS), ids=lambda c: f"sm{c[0]}{c[1]}")
def card(request, monkeypatch):
    """One CUDA GPU of the given compute capability, with torch claiming bf16 (emulated or not) works."""
    capability = request.param
    name = CARDS[capability][0]
    props = SimpleNamespace(
        name=name, total_memory=16 * 2**30, major=capability[0], minor=capability[1], multi_processor_count=40
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return CARDS[capability]


def test_bf16_is_native_only(card):
    assert bf16_native(0) is card[1]


def test_devices_and_train_agree(card, capsys):
    _, native, precision = card
    assert main(["devices", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cuda"][0]["bf16"] is native
    assert out["train_default"]["precision"] == precision
    assert resolve_precision("auto", "cuda") == precision
    assert computes_bf16("cuda") is native  # what bench calibrates in and serve --dtype auto loads


def test_no_cuda_means_no_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bf16_native(0) is False
