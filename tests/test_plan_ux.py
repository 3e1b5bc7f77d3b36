"""`gpuwise plan --workload NAME --traced` as typed: the task is implied (a workload is trained), and
without --gpu the plan is for the device here, in the precision `gpuwise train` would pick there."""

import json

import pytest

from gpuwise.cli import main
from gpuwise.hardware import devices
from gpuwise.hardware.cpu import CpuInfo

CPU = CpuInfo(
    model="Test CPU",
    vendor="AuthenticAMD",
    arch="x86_64",
    cores=2,
    logical=2,
    isa=["avx2", "fma"],
    ram_bytes=16 * 2**30,
    clock_ghz=2.5,
    clock_origin="test",
    fp32_flop_per_cycle=32,
    fp32_rule="test",
    bf16_flop_per_cycle=None,
    bf16_rule="test",
)


def gpu(name: str, bf16: bool, slug: str | None) -> devices.GpuInfo:
    return devices.GpuInfo(0, name, 16 * 2**30, "8.9" if bf16 else "7.5", 40, bf16, slug, None)


@pytest.fixture
def here(monkeypatch):
    """Make this machine whatever a test says: detection is the hardware layer's; the CLI only asks it."""

    def make(*cuda: devices.GpuInfo) -> None:
        monkeypatch.setattr(devices, "detect", lambda catalog: devices.Devices(CPU, list(cuda), False, "test"))

    return make


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> str:
    """A --module factory that traces in a blink: the defaults do not depend on what is traced."""
    (tmp_path / "ux_models.py").write_text(
        "import torch\ndef factory():\n    return torch.nn.Linear(64, 8), torch.randn(4, 64)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "ux_models:factory"


def plan_json(capsys, *argv: str) -> tuple[dict, str]:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_traced_workload_on_the_cpu_needs_no_task_nor_gpu(capsys, here):
    here()
    res, err = plan_json(capsys, "--workload", "defects", "--traced")
    assert res["traced"] and res["gpu"] == "cpu" and res["precision"] == "fp32"  # train's choice on a CPU
    assert res["capacity"] == CPU.ram_bytes and res["fits"]
    assert "bandwidth is unknown" in res["method"]
    assert "no --gpu: planning for the device here, Test CPU (this CPU), in fp32" in err


def test_traced_defaults_to_the_gpu_here_in_trains_precision(capsys, here, tiny):
    here(gpu("Tesla T4", bf16=False, slug="t4"))
    res, err = plan_json(capsys, "--module", tiny)
    # A T4 has no native bf16 (the catalog lists no bf16 peak): train picks 16-mixed, so the plan is fp16.
    assert res["gpu"] == "t4" and res["precision"] == "fp16"
    assert "Tesla T4" not in err and "NVIDIA T4 (t4), in fp16" in err


def test_given_flags_win_over_the_device_here(capsys, here, tiny):
    here(gpu("NVIDIA L4", bf16=True, slug="l4"))
    res, err = plan_json(capsys, "--module", tiny, "--gpu", "h100-sxm", "--precision", "fp32")
    assert res["gpu"] == "h100-sxm" and res["precision"] == "fp32" and "no --gpu" not in err


@pytest.mark.parametrize(
    "cuda,argv,needle",
    [
        ([], ["--task", "inference"], "use --task finetune or pretrain"),
        ([gpu("Mystery GPU", bf16=True, slug=None)], [], "this machine's GPU (Mystery GPU) is not in the catalog"),
        ([], ["--gpu", "nope-9000"], "unknown accelerator 'nope-9000'"),
    ],
)
def test_traced_refusals_stay_one_line(capsys, here, tiny, cuda, argv, needle):
    here(*cuda)
    assert main(["plan", "--module", tiny, "--traced", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_an_analytic_plan_still_defaults_to_inference_in_bf16(capsys):
    res, _ = plan_json(capsys, "--model", "llama-3.1-8b", "--gpu", "h100-sxm")
    assert res["task"] == "inference" and res["precision"] == "bf16"


def test_help_states_the_traced_defaults():
    import typer

    from gpuwise.cli import app

    helps = {p.name: p.help for p in typer.main.get_command(app).commands["plan"].params}
    assert "finetune when tracing" in helps["task"] and "the GPU here" in helps["gpu"]
    assert "what `gpuwise train` picks here" in helps["precision"]
