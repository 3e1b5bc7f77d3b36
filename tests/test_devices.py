"""Device detection: the FLOP/cycle rules, the engine choice, and a real detection here."""

from gpuwise.hardware.cpu import detect_cpu, flop_per_cycle
from gpuwise.hardware.devices import GpuInfo, choose_engine, computes_bf16, detect


def test_zen4_and_xeon_flop_per_cycle_match_the_reference_derivations():
    # hardware/data/accelerators.csv derives the EPYC 9654 (Zen 4) at 32 and the Xeon 8480+ at 64
    # FP32 FLOP/clk/core, and AMX at 1024 BF16 ops/clk/core.
    zen4 = flop_per_cycle("AuthenticAMD", {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert zen4[0] == 32 and zen4[2] == 64
    spr = flop_per_cycle("GenuineIntel", {"avx2", "fma", "avx512f", "amx_tile", "amx_bf16"})
    assert spr[0] == 64 and spr[2] == 1024
    assert flop_per_cycle("GenuineIntel", {"avx2", "fma"})[0] == 32


def test_published_nominal_peak_of_this_kind_of_machine():
    # 2.6 GHz x 32 FLOP/cycle x 2 cores = 166 GFLOP/s fp32 (Zen 4 here).
    cpu = detect_cpu()
    assert cpu.cores >= 1 and cpu.ram_bytes > 0
    if cpu.fp32_peak_gflops:
        assert cpu.fp32_peak_gflops == cpu.cores * cpu.fp32_flop_per_cycle * cpu.clock_ghz
        assert "FLOP/cycle" in cpu.derivation


def gpu(bf16):
    return GpuInfo(0, "x", 1, "8.0" if bf16 else "7.5", 1, bf16, None, None)


def test_engine_choice_prefers_cuda_then_mps_then_cpu():
    assert choose_engine([gpu(True), gpu(True)], mps=True) | {"why": ""} == {
        "accelerator": "cuda",
        "devices": 2,
        "precision": "bf16-mixed",
        "why": "",
    }
    assert choose_engine([gpu(False)], mps=False)["precision"] == "16-mixed"
    assert choose_engine([], mps=True)["accelerator"] == "mps"
    assert choose_engine([], mps=False) | {"why": ""} == {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "why": "",
    }
    # A CPU with bf16 instructions autocasts to bf16; a GPU still comes first.
    assert choose_engine([], mps=False, cpu_bf16=True)["precision"] == "bf16-mixed"
    assert choose_engine([gpu(False)], mps=False, cpu_bf16=True)["precision"] == "16-mixed"


def test_cpu_bf16_rule_follows_the_isa():
    from gpuwise.hardware.cpu import flop_per_cycle

    base = {"avx512f", "avx2", "fma"}
    for flags, native in ((base, False), (base | {"avx512_bf16"}, True), (base | {"amx_bf16"}, True)):
        bf16_per_cycle = flop_per_cycle("GenuineIntel", flags)[2]
        assert (bf16_per_cycle is not None) == native, flags


def test_train_auto_precision_on_cpu_is_what_devices_reports(catalog):
    from gpuwise.train.engine import resolve_precision

    dev = detect(catalog)
    assert resolve_precision("auto", "cpu") == ("bf16-mixed" if dev.cpu.bf16_native else "32-true")
    assert computes_bf16("cpu") is dev.cpu.bf16_native and not computes_bf16("mps")
    if not dev.cuda and not dev.mps:
        assert dev.train_default()["precision"] == resolve_precision("auto", "cpu")


def test_detect_runs_here(catalog):
    dev = detect(catalog)
    assert dev.torch_version and dev.cpu.cores >= 1
    assert dev.as_dict()["train_default"]["accelerator"] in ("cuda", "mps", "cpu")
