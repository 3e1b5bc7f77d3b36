"""Weights of 8 and 4 bits in gpuwise's engine (serve/engines/gpuwise/quant.py, the block formats read by
kernels/decode_attention.cpp): the formats are llama.cpp's to the byte, the kernels' products are the
dequantize-then-multiply reference's at 1, 3, 8 and 64 rows, the whole decode step over quantized weights is the
Python forward's over the same weights, the weights are held once, and the plan counts what is held."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_decoder import prefill_then_step, tiny

from gpuwise.serve.engines.gpuwise import attention
from gpuwise.serve.engines.gpuwise import decoder as fused
from gpuwise.serve.engines.gpuwise.quant import FORMATS, INTERLEAVED, WEIGHTS, dequantize, interleave, quantize


@pytest.fixture(scope="module")
def kernel():
    loaded, why = attention.load()
    if loaded is None:
        pytest.skip(f"no decode kernel here: {why}")
    return loaded


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_formats_are_llama_cpps_to_the_byte(fmt):
    """gguf-py (llama.cpp's own package) reads what quant.py writes, and quant.py's dequantize is gguf-py's
    bitwise; the bits per weight are the planner's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    from gpuwise.plan.memory import SERVED_BITS

    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.linspace(0.01, 3, 96)  # blocks of very different ranges
    q = quantize(w, fmt)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    assert (block, size) == (32, FORMATS[fmt].block_bytes)
    assert q.data.shape == (40, 96 // 32 * size) and q.nbytes == 40 * 96 * FORMATS[fmt].bits / 8
    theirs = torch.from_numpy(quants.dequantize(q.data.numpy(), GGMLQuantizationType[fmt]))
    assert torch.equal(dequantize(q), theirs)
    # the quantization error is the format's: half a step of the block's scale (Q4_0: a step, its largest value
    # only reaches 7/8 of the block's largest magnitude of the other sign), plus the fp16 scale's rounding
    step = {"Q8_0": 1 / 127, "Q4_0": 2 / 8, "Q4_1": 1 / 15}[fmt]
    span = w.reshape(40, 3, 32).abs().amax(-1, keepdim=True) * (2 if fmt == "Q4_1" else 1)
    assert bool(((dequantize(q) - w).reshape(40, 3, 32).abs() <= span * step * 0.6).all())
    for weights, (layers, head) in ((k, v) for k, v in WEIGHTS.items() if v):
        assert SERVED_BITS[weights] == (FORMATS[layers].bits, FORMATS[head].bits)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize(torch.zeros(4, 40), fmt)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel's bf16 products by blocks read it: a block of 32 at a time, d = max |x| / 127 and q = x / d
    rounded to nearest even (llama.cpp's Q8_0 of the activations), dequantized in fp32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, 45, 64])
def test_the_quantized_product_is_dequantize_then_multiply(kernel, fmt, rows, dtype):
    """In fp32, at 1-8 rows the kernel dequantizes in registers as it reads, at more it dequantizes 16 weight rows at
    a time into its cache: both are F.linear on the dequantized weight. In bf16 at 1-8 rows the activations are int8
    too, a block of 32 at a time (integer dot products, as llama.cpp's): F.linear on both dequantized; at more rows,
    where the CPU has AMX, the weights are dequantized to bf16 for its tiles (as the library's product on them
    reads them); without AMX, int8 activations at any size (the engine sends the rows from decoder.KERNEL_ROWS on
    to the library's product instead). Bound: fp32 sums in another order (measured 1e-7 to 6e-7 of the largest
    output), and in bf16 the output's one rounding (2^-8 = 3.9e-3; measured up to 3.3e-3). Allowed: 1e-5 and 5e-3;
    and in bf16, 8e-3 of the product of the exact activations and fp32 weights (int8 activations' own error, with
    the rounding, measured up to 7.5e-3 of the largest output)."""
    torch.manual_seed(rows)
    w, bias = torch.randn(200, 608), torch.randn(200)  # 19 blocks a row, an odd one at the end; 6 tiles and a part
    q = quantize(w, fmt)
    x = torch.randn(rows, 608).to(dtype)
    got = kernel.qgemv(x, q, bias.to(dtype))
    weights, read = dequantize(q), x.float()
    if dtype == torch.bfloat16 and kernel.amx and rows > attention.GEMV_ROWS:
        weights = dequantize(q, torch.bfloat16).float()
    elif dtype == torch.bfloat16:
        read = int8_activations(x)
    expected = read @ weights.T + bias.to(dtype).float()
    assert got.shape == (rows, 200) and got.dtype == dtype
    off = float((got.float() - expected).abs().max() / expected.abs().max())
    assert off <= {torch.float32: 1e-5, torch.bfloat16: 5e-3}[dtype], off
    exact = x.float() @ dequantize(q).T + bias.to(dtype).float()
    off = float((got.float() - exact).abs().max() / exact.abs().max())
    assert off <= {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype], off
    # [..., I] inputs keep their leading dimensions, as F.linear's
    assert kernel.qgemv(x.view(1, rows, 608), q).shape == (1, rows, 200)


@pytest.mark.parametrize("fmt", sorted(INTERLEAVED))
def test_four_rows_interleaved_are_the_same_bytes_and_the_same_products(kernel, fmt):
    """quant.interleave lays Q8_0 and Q4_1 out four rows at a time: the same bytes, the same rows back (`take`,
    `dequantize`), and the kernels' products of it are the products of the blocks as they ship. For Q8_0 they are
    bitwise, at every size (the same integer sums, scaled and added in the same order); for Q4_1 in fp32 too, and
    in bf16 its 1-8 row products add the same terms in another order: within bf16's output rounding (2^-8 of the
    largest output). A shape that is not whole groups of whole pairs is left as it ships."""
    torch.manual_seed(3)
    w, bias = torch.randn(200, 640), torch.randn(200)
    q = quantize(w, fmt)
    x4 = interleave(q)
    assert x4.fmt == INTERLEAVED[fmt] and x4.fmt.interleaved and x4.nbytes == q.nbytes
    assert not torch.equal(x4.data.reshape(-1), q.data.reshape(-1))  # laid out anew, not a copy
    assert torch.equal(x4.take(slice(None)).data, q.data) and torch.equal(dequantize(x4), dequantize(q))
    ids = torch.tensor([199, 0, 5, 5, 102])
    assert torch.equal(x4.take(ids).data, q.data[ids])
    assert torch.equal(kernel.dequantize(x4, slice(6, 43), torch.float32), dequantize(q)[6:43])
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 8, 64):
            x = torch.randn(rows, 640).to(dtype)
            ours, shipped = kernel.qgemv(x, x4, bias.to(dtype)), kernel.qgemv(x, q, bias.to(dtype))
            if fmt == "Q8_0" or dtype == torch.float32:
                assert torch.equal(ours, shipped), (dtype, rows)
            else:
                off = float((ours.float() - shipped.float()).abs().max() / shipped.float().abs().max())
                assert off <= 2**-8, (rows, off)
    for shape in ((202, 640), (200, 608)):  # rows not in fours; an odd block at the end of a row
        assert not interleave(quantize(torch.randn(*shape), fmt)).fmt.interleaved


@pytest.mark.parametrize("rows", [9, 45, 200])
def test_a_plain_bf16_product_of_many_rows_on_amx_reads_the_weight_as_stored(kernel, rows):
    """Where AMX's tiles are granted, the kernel takes a plain bf16 weight at any number of rows: its rows are the
    tiles' A operand as they are stored (a last part of fewer than 32 rows copied beside zeros), fp32 sums, one
    rounding to bf16. Bound: the output's rounding, 2^-8 of the largest output (measured up to 3.0e-3). 200 x 608:
    6 tasks of 32 rows and a part of 8; 19 blocks a row; 45 rows: a group of 16 input rows and a part."""
    if not kernel.amx:
        pytest.skip("AMX's tiles are not granted here")
    torch.manual_seed(rows)
    x, w, bias = (torch.randn(*s).to(torch.bfloat16) for s in ((rows, 608), (200, 608), (200,)))
    got = kernel.gemv(x, w, bias)
    expected = x.float() @ w.float().T + bias.float()
    off = float((got.float() - expected).abs().max() / expected.abs().max())
    assert got.shape == (rows, 200) and got.dtype == torch.bfloat16 and off <= 2**-8, off
    with pytest.raises(ValueError):  # rows not of whole blocks: the tiles do not take them past GEMV_ROWS
        kernel.gemv(torch.randn(rows, 600).to(torch.bfloat16), torch.randn(200, 600).to(torch.bfloat16))


def test_the_kernel_uses_what_this_cpu_has():
    """VNNI's int8 dot products and AMX's tiles are compiled in where the CPU has them (attention.FLAGS), and AMX
    is taken only where it is built in (and Linux grants its tile state): a build that silently lost them would
    pass the products' tests on the fallbacks and be slower."""
    loaded, why = attention.load()
    if loaded is None:
        pytest.skip(f"no decode kernel here: {why}")
    flags = attention._cpu_flags()
    assert ("-mavx512vnni" in attention.FLAGS) == ("avx512_vnni" in flags)
    assert loaded.amx_built == ({"amx_tile", "amx_bf16"} <= flags) and loaded.amx <= loaded.amx_built


@pytest.mark.parametrize("rows", [3, 40, 200])
def test_a_quantized_layer_is_dequantize_then_multiply_at_few_rows_and_many(kernel, rows):
    """The engine's product (decoder._Linear, quantized): the kernel's below its crossover (_library_rows:
    KERNEL_ROWS, AMX_ROWS where the CPU has AMX), above it the library's product on chunks of dequantized rows (2600
    rows: two chunks and a part); within bf16's output rounding of the reference either way, and no plain weight
    kept."""
    torch.manual_seed(1)
    w, bias = torch.randn(2600, 64).bfloat16(), torch.randn(2600).bfloat16()
    layer = fused._Linear(w, bias, None, kernel)
    layer.quantize("Q4_1")
    assert layer.weight is None and layer.nbytes == 2600 * 64 // 32 * 20
    x = torch.randn(rows, 64).bfloat16()
    expected = x.float() @ dequantize(layer.quant).T + bias.float()
    got = layer(x)
    off = float((got.float() - expected).abs().max() / expected.abs().max())
    assert got.shape == (rows, 2600) and off <= 8e-3, off


@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
def test_which_quantized_products_the_kernel_takes_and_which_the_library(kernel, monkeypatch, amx):
    """The crossovers benchmarks/quant_products.py measured, as the engine asks them: bf16 products on int8
    activations stay in the kernel to KERNEL_ROWS by format (to AMX_ROWS on AMX's tiles), fp32 ones to
    LIBRARY_ROWS; a format without its own crossover goes as fp32's."""
    monkeypatch.setattr(kernel, "amx", amx)
    took: list[str] = []
    monkeypatch.setattr(kernel, "qgemv", lambda x, q, bias=None: took.append("kernel"))
    monkeypatch.setattr(fused._Linear, "_qlinear", lambda self, x: took.append("library"))
    for fmt, bf16_rows in (
        ("Q8_0", fused.KERNEL_ROWS[FORMATS["Q8_0"].ggml_type]),
        ("Q4_1", fused.KERNEL_ROWS[FORMATS["Q4_1"].ggml_type]),
        ("Q4_0", None),
    ):
        layer = fused._Linear(torch.randn(8, 64).bfloat16(), None, None, kernel)
        layer.quantize(fmt)
        bf16_rows = fused.AMX_ROWS + 1 if amx else bf16_rows or fused.LIBRARY_ROWS
        for dtype, most in ((torch.bfloat16, bf16_rows), (torch.float32, fused.LIBRARY_ROWS)):
            for rows, way in ((1, "kernel"), (most - 1, "kernel"), (most, "library")):
                took.clear()
                layer(torch.zeros(rows, 64, dtype=dtype))
                assert took == [way], (fmt, dtype, rows)


def test_the_quantized_product_refuses_what_it_does_not_take(kernel):
    q = quantize(torch.randn(8, 64), "Q8_0")
    with pytest.raises(ValueError, match="qgemv"):
        kernel.qgemv(torch.randn(2, 32), q)  # the wrong width
    with pytest.raises(ValueError, match="qgemv"):
        kernel.qgemv(torch.randn(2, 64).half(), q)  # fp16 activations


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_a_quantized_decode_step_in_one_kernel_call_is_the_python_forward(kernel, weights, dtype, n):
    """The whole-step kernel reads the same blocks the Python forward's products read (through the same
    loaders), so their logits agree as the plain weights' do (test_decoder.py): 1e-5 in fp32, 1e-2 in bf16.
    The weights are held once: quantized products only, the model's own layers moved out, and the output layer
    tied to the embedding is the embedding too (looked up in its blocks)."""

    model = tiny("llama", tie_word_embeddings=True).to(dtype)
    decoder, note = fused.fused_decoder(model, None, weights)
    assert decoder is not None and f"weights {weights}: layers" in note, note
    assert decoder.step is not None
    products = [*decoder.linears(), decoder.head]
    assert all(x.quant is not None and x.weight is None and x.packed is None for x in products)
    assert decoder.embed is None and decoder.embed_q is decoder.head.quant
    assert isinstance(model.model.layers[0].self_attn.q_proj, fused.Moved)
    assert isinstance(model.model.embed_tokens, fused.Moved)

    def step(use_kernel: bool) -> torch.Tensor:
        return prefill_then_step(decoder, model.config, dtype, n, use_kernel)

    python, kernel_step = step(False), step(True)
    off = float((kernel_step - python).abs().max() / python.abs().max())
    assert off <= {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype], off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_logits_stay_near_the_plain_ones_on_the_tiny_model(kernel, dtype):
    """A loose hold on quality (benchmarks/quant_quality.py measures it on SmolLM2-135M against llama.cpp): on a
    tiny model with its weights scaled up so that it predicts sharply, the next-token cross-entropy of a prompt
    under int8 is within 1 % of the plain weights' and under int4 within 10 %, and int8 is the nearer. In bf16
    the decode steps' products read int8 activations too."""
    torch.manual_seed(0)
    model = tiny("llama").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0 if p.dim() == 2 else 1.0)
    ids = torch.randint(0, 300, (1, 48))

    def entropy(weights: str) -> float:
        import copy

        m = copy.deepcopy(model)
        decoder, note = fused.fused_decoder(m, None, weights)
        assert decoder is not None, note
        with torch.inference_mode():
            logits = _all_logits(decoder, m.config, ids)
        return float(torch.nn.functional.cross_entropy(torch.stack(logits[:-1]), ids[0, 1:]))

    plain, int8, int4 = entropy("bf16"), entropy("int8"), entropy("int4")
    assert abs(int8 - plain) <= 0.01 * plain, (plain, int8)
    assert abs(int4 - plain) <= 0.10 * plain, (plain, int4)
    assert abs(int8 - plain) <= abs(int4 - plain)


def _all_logits(decoder, config, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each position's logits, one decode step at a time through the engine's cache (the fused forward returns
    a row's last column only)."""
    from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, additive_mask

    n = ids.shape[1]
    cache = PagedCache.for_rows(config, 1, decoder.dtype, "cpu", context=n)
    out = []
    for t in range(n):
        pos = torch.tensor([[t]])
        cache.bind(cache.row_table, pos, n)
        allowed = torch.arange(n).view(1, 1, 1, n) <= t
        out.append(decoder(ids[:, t : t + 1], pos, additive_mask(allowed, decoder.dtype), cache)[0])
    return out


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_plan_counts_the_weights_the_engine_holds(kernel, weights):
    """`gpuwise plan`'s bytes per weight (plan/memory.py SERVED_BITS) against the bytes the quantized decoder
    holds, measured: within 2 % (the norms, which the plan does not count apart); an untied output layer too."""
    from gpuwise.plan.memory import served_weight_bytes
    from gpuwise.workloads.pretrained import spec_of

    for tied in (True, False):
        model = tiny("llama", tie_word_embeddings=tied)
        spec = spec_of(model)
        decoder, note = fused.fused_decoder(model, None, weights)
        assert decoder is not None, note
        held, planned = decoder.held_bytes(), served_weight_bytes(spec, weights)
        # an untied model keeps its embedding plain (bf16 or the model's dtype): read a row at a time, not a product
        if not tied:
            planned += spec.hidden * 300 * (4 - 8.5 / 8)  # fp32 here, where the plan counts Q8_0
        assert math.isclose(held, planned, rel_tol=0.02), (tied, held, planned)


def test_what_the_quantized_kernels_do_not_serve_is_one_line():
    gemma = tiny("gemma")
    with pytest.raises(fused.NotQuantizable, match="--weights int8 runs on gpuwise.s fused decoder, which"):
        fused.fused_decoder(gemma, None, "int8")


def test_the_kernel_takes_only_the_formats_it_knows(kernel):
    """A format id the kernels do not know, or a block format over rows that are not whole blocks, is refused
    (rc 1) rather than read."""
    x, out = torch.randn(1, 64), torch.empty(1, 8)
    w = np.zeros((8, 64 // 32 * 34), np.uint8)
    assert kernel.gemv_fn(0, 7, x.data_ptr(), w.ctypes.data, 0, out.data_ptr(), 1, 8, 64, 0) == 1
    assert kernel.gemv_fn(0, 8, x.data_ptr(), w.ctypes.data, 0, out.data_ptr(), 1, 8, 48, 0) == 1
    assert kernel.gemv_fn(0, 8, x.data_ptr(), w.ctypes.data, 0, out.data_ptr(), 1, 8, 64, 0) == 0
    for fmt in INTERLEAVED.values():  # four rows at a time: whole groups (rows in fours) of whole pairs of blocks
        args = (x.data_ptr(), w.ctypes.data, 0, out.data_ptr(), 1)
        assert kernel.gemv_fn(0, fmt.kernel, *args, 8, 64, 0) == 0
        assert kernel.gemv_fn(0, fmt.kernel, *args, 6, 64, 0) == 1
        assert kernel.gemv_fn(0, fmt.kernel, *args[:-1], 1, 8, 32, 0) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "int9"], "--weights int9: choose auto, bf16, int8, int4"),
        (["--weights", "bf16", "--dtype", "fp32"], "--weights bf16 with --dtype fp32: give one of them"),
        (["--weights", "int4", "--dtype", "q8_0"], "--weights int4 computes in bf16 or fp32 (--dtype), not q8_0"),
    ],
)
def test_serve_weights_flags_are_checked_before_anything_loads(flags, message, capsys):
    from gpuwise.cli.app import main

    assert main(["serve", "smollm2-135m-instruct", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"gpuwise: error: {message}\n"


def test_the_named_bases_q4_1_file_loads_into_the_engine_as_it_ships(kernel):
    """SmolLM2-135M-Instruct ships as a Q4_1 GGUF (Q8_0 embedding): `--weights int4` takes its blocks as they are
    (q and k rows put back in transformers' order, four rows laid out at a time), every product of them, and the
    tied embedding is the file's Q8_0 table. What they hold is exactly the weights transformers dequantizes from
    the same file, so in fp32 the engine's logits are transformers' fp32 forward's within the order of the sums
    (measured below 1e-5 of the largest logit; allowed 1e-4)."""
    from transformers import AutoModelForCausalLM

    from gpuwise.plan.bases import named_base_path
    from gpuwise.serve.engines.gpuwise.kvcache import PagedCache, additive_mask
    from gpuwise.serve.engines.gpuwise.quant import gguf_blocks
    from gpuwise.workloads.pretrained import resolve_base

    source = resolve_base("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    reference = AutoModelForCausalLM.from_pretrained(source).eval()
    layer = model.model.layers[0]
    plain_qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    plain_qkv = plain_qkv.detach().clone()
    decoder, note = fused.fused_decoder(model, None, "int4", gguf_blocks(named_base_path("smollm2-135m-instruct")))
    assert decoder is not None and "121 of 121 products as the GGUF ships them" in note, note
    assert torch.equal(dequantize(decoder.layers[0].qkv.quant), plain_qkv)
    assert decoder.head.quant.fmt == INTERLEAVED["Q8_0"] and decoder.embed_q is decoder.head.quant
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2]])
    # the tied embedding's rows: gathered from the interleaved blocks for a prompt, by the kernel for a step's few
    table = dequantize(decoder.embed_q)
    assert torch.equal(decoder._embed(ids), table[ids]) and torch.equal(decoder._embed(ids[:, :3]), table[ids[:, :3]])
    n = ids.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    cache = PagedCache.for_rows(reference.config, 1, torch.float32, "cpu", context=n)
    cache.bind(cache.row_table, pos, n)
    with torch.inference_mode():
        ours = decoder(ids, pos, additive_mask(pos.view(1, 1, n, 1) >= pos.view(1, 1, 1, n), torch.float32), cache)
        theirs = reference(input_ids=ids).logits[:, -1].float()
    off = float((ours - theirs).abs().max() / theirs.abs().max())
    assert off <= 1e-4, off
