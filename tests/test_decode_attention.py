"""gpuwise's CPU decode attention kernel (serve/engines/gpuwise/attention.py) against PyTorch's SDPA on the same
cache views, and what happens where it cannot be built: the decoder keeps SDPA and says why."""


import pytest
import torch
import torch.nn.functional as F

from gpuwise.serve.engines.gpuwise import attention

needs_kernel = pytest.mark.skipif(bool(attention.unavailable()), reason=f"no kernel here: {attention.unavailable()}")


def sdpa(q, keys, values, lens):
    """What the decoder computed before the kernel: one query per row, causal over each row's positions."""
    n, H, D = q.shape
    K, length = keys.shape[2], keys.shape[1]
    allowed = torch.arange(length).view(1, length) < lens.view(n, 1)
    bias = torch.zeros(n, 1, 1, length, dtype=q.dtype).masked_fill_(~allowed.view(n, 1, 1, length),
                                                                     torch.finfo(q.dtype).min)
    out = F.scaled_dot_product_attention(q.reshape(n, K, H // K, D), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=bias)
    return out.reshape(n, H, D)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 32), (2, 1, 256)])
def test_the_kernel_gives_sdpas_attention(dtype, heads, kv_heads, head_dim):
    kernel, why = attention.load()
    assert kernel is not None, why
    torch.manual_seed(0)
    slots, capacity, first, n, length = 12, 80, 3, 7, 53
    # a layer of a slot cache bigger than what is bound: rows first..first+n-1, positions up to length
    keys = torch.randn(slots, capacity, kv_heads, head_dim).to(dtype)
    values = torch.randn(slots, capacity, kv_heads, head_dim).to(dtype)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim).to(dtype)  # the query a view into a wider product
    q = qkv[:, :heads]
    lens = torch.tensor([1, 53, 17, 16, 33, 2, 48])
    k, v = keys[first:first + n, :length], values[first:first + n, :length]
    got = kernel(q, k, v, lens)
    assert got.dtype == dtype and got.shape == (n, heads, head_dim)
    # against SDPA in fp32 on the same inputs: in fp32 the sums differ only in order; in bf16 the kernel rounds
    # its fp32 result once (half an ulp, 2^-9 of the value), where SDPA's bf16 kernel also rounds its weights
    expected = sdpa(q.float(), k.float(), v.float(), lens)
    tolerance = 2e-6 if dtype == torch.float32 else 2**-8
    off = float((got.float() - expected).abs().max() / expected.abs().max())
    assert off <= tolerance, off
    theirs = float((sdpa(q, k, v, lens).float() - expected).abs().max() / expected.abs().max())
    assert off <= max(theirs, 2e-6)  # never further from the fp32 result than SDPA in the same dtype
    # a row's result depends on its own keys only: the rows alone give the same bits
    for i in (0, 4):
        alone = kernel(q[i:i + 1], k[i:i + 1], v[i:i + 1], lens[i:i + 1])
        assert torch.equal(alone[0], got[i])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_through_block_tables_the_kernel_reads_what_the_rows_hold_in_their_blocks(dtype):
    """A paged cache's layer: rows whose blocks are shuffled through the pool, a block size that is no multiple of
    16, rows ending mid-block: the kernel through the tables gives the same bits as on the rows gathered whole."""
    kernel, why = attention.load()
    assert kernel is not None, why
    torch.manual_seed(1)
    H, K, D, block, blocks = 6, 2, 32, 5, 40
    pool_k = torch.randn(blocks, block, K, D).to(dtype)
    pool_v = torch.randn(blocks, block, K, D).to(dtype)
    order = torch.randperm(blocks)
    lens = torch.tensor([23, 1, 5, 14])
    per = 5  # blocks a row's table holds (25 positions)
    table = order[: 4 * per].view(4, per).contiguous()
    q = torch.randn(4, H, D).to(dtype)
    got = kernel(q, pool_k, pool_v, lens, table)
    rows_k = pool_k[table].reshape(4, per * block, K, D)  # each row's positions, gathered in order
    rows_v = pool_v[table].reshape(4, per * block, K, D)
    assert torch.equal(got, kernel(q, rows_k, rows_v, lens))
    expected = sdpa(q.float(), rows_k.float(), rows_v.float(), lens)
    off = float((got.float() - expected).abs().max() / expected.abs().max())
    assert off <= (2e-6 if dtype == torch.float32 else 2**-8), off


@needs_kernel
def test_the_kernel_refuses_what_it_does_not_take():
    kernel, _ = attention.load()
    assert kernel is not None
    q, kv = torch.randn(2, 4, 24), torch.randn(2, 8, 2, 24)  # head dim 24: not a multiple of 16
    with pytest.raises(ValueError, match="does not take"):
        kernel(q, kv, kv, torch.tensor([8, 8]))
    with pytest.raises(ValueError, match="do not match"):
        kernel(torch.randn(2, 4, 32), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16), torch.tensor([8, 8]))
    assert not kernel.supports(torch.float16, 64, torch.device("cpu"))
    assert not kernel.supports(torch.float32, 72, torch.device("cpu"))


def test_where_it_cannot_be_built_the_decoder_keeps_sdpa_and_says_why(monkeypatch, tmp_path):
    from test_decoder import tiny

    from gpuwise.serve.engines.gpuwise import decoder as fused

    monkeypatch.setenv("GPUWISE_CACHE", str(tmp_path))
    attention.load.cache_clear()
    try:
        monkeypatch.setenv("GPUWISE_KERNELS", "0")
        assert attention.load() == (None, "GPUWISE_KERNELS=0")
        decoder, note = fused.fused_decoder(tiny("llama"), pack=None)
        assert decoder is not None and decoder.attention is None
        assert note.endswith("decode attention: SDPA (GPUWISE_KERNELS=0))")
        if not attention.unavailable():
            attention.load.cache_clear()
            monkeypatch.delenv("GPUWISE_KERNELS")
            monkeypatch.setenv("CXX", "false")  # a compiler that fails
            kernel, why = attention.load()
            assert kernel is None and why.startswith("building it failed"), why
            assert not list(tmp_path.rglob("*.so"))  # nothing half-built left to load
    finally:
        attention.load.cache_clear()
