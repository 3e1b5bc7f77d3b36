"""Weights of 8 and 4 bits for gpuwise's engine: llama.cpp's block formats Q8_0, Q4_0 and Q4_1, held as they are
laid out in a GGUF file (so that a quantized GGUF loads without conversion) and read by the decode kernels
(kernels/decode_attention.cpp), which dequantize them in registers: no dequantized copy is kept.

Why these formats: a decode step reads every weight once, so its speed is bytes per weight (docs/serving.md,
"One stream"). Blocks of 32 values along a row with an fp16 scale (and, for Q4_1, an fp16 minimum) are what
llama.cpp ships its files in; quantizing with llama.cpp's own reference code (gguf-py's `gguf.quants`, the same
arithmetic as ggml's `quantize_row_*_ref`) makes a file gpuwise quantized and one llama.cpp quantized the same
bytes, and the quality comparison between the engines one of the kernels alone (benchmarks/quant_quality.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants  # gguf-py: llama.cpp's own Python package

BLOCK = 32  # values a block holds, along a row


@dataclass(frozen=True)
class Format:
    """One of llama.cpp's block formats: its name, ggml's type id, bytes per block; `interleaved`: its blocks laid
    out four rows at a time for the kernels (`interleave`), the same bytes."""

    name: str
    ggml_type: int
    block_bytes: int
    interleaved: bool = False

    @property
    def bits(self) -> float:
        """Bits per weight, scales included: 8.5 for Q8_0, 4.5 for Q4_0, 5 for Q4_1."""
        return self.block_bytes * 8 / BLOCK

    @property
    def kernel(self) -> int:
        """The kernels' id of the format (kernels/decode_attention.cpp): ggml's type, 100 more interleaved."""
        return self.ggml_type + 100 if self.interleaved else self.ggml_type


FORMATS = {f.name: f for f in (Format("Q8_0", 8, 34), Format("Q4_0", 2, 18), Format("Q4_1", 3, 20))}
BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}
# the formats `interleave` lays out four rows at a time, by the one they interleave, and their blocks' fp16 fields
INTERLEAVED = {"Q8_0": Format("Q8_0x4", 8, 34, interleaved=True), "Q4_1": Format("Q4_1x4", 3, 20, interleaved=True)}
FIELDS = {"Q8_0": 1, "Q4_1": 2}  # fp16 values a block starts with: d (and m)
GROUP = 4  # rows an interleaved group holds

# `--weights`: the format of the layers' products and of the output layer. At 4 bits the output layer keeps 8
# (it is a large share of a small model's error, and llama.cpp's own 4-bit files keep it at 6-8 bits too).
WEIGHTS = {"bf16": None, "int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}
QUANTIZED = tuple(k for k, v in WEIGHTS.items() if v)


@dataclass(frozen=True)
class QuantWeight:
    """A weight [rows, cols] in `fmt`: `data` is uint8 [rows, cols / 32 * block bytes], each row its blocks."""

    fmt: Format
    data: torch.Tensor
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def take(self, rows: torch.Tensor | slice) -> QuantWeight:
        """Some of its rows (a view for a slice, a copy for an index tensor): quantized rows are independent. Of an
        interleaved weight, a copy of the rows in the format it interleaves."""
        if self.fmt.interleaved:
            ids = torch.arange(self.rows)[rows] if isinstance(rows, slice) else rows.reshape(-1)
            return _rows_of(self, ids)
        data = self.data[rows]
        return QuantWeight(self.fmt, data, data.shape[0], self.cols)


def interleave(q: QuantWeight) -> QuantWeight:
    """Q8_0 or Q4_1 laid out for the kernels' products of few rows, four rows at a time (where its rows come in
    fours and its blocks in pairs; else `q` as it is). Per group of 4 rows and pair of blocks: the fp16 scales [rows
    0-3 of block b, rows 0-3 of block b + 1] (Q4_1: then its minimums the same way), then each row's two blocks'
    quants (Q8_0's as unsigned bytes, q + 128). The same bytes: a thread reads one stream, a row's two blocks in
    one load with nothing to move, 4 rows' scales in one (docs/serving.md, "Four rows at a time"). Why by hand:
    llama.cpp repacks its own CPU weights likewise (ggml-cpu's repack.cpp), but only inside its own buffers."""
    if q.fmt.interleaved or q.fmt.name not in INTERLEAVED or q.rows % GROUP or q.cols % (2 * BLOCK):
        return q
    fields, size = FIELDS[q.fmt.name], q.fmt.block_bytes
    groups, pairs, head = q.rows // GROUP, q.cols // (2 * BLOCK), 2 * FIELDS[q.fmt.name]
    blocks = q.data.reshape(groups, GROUP, pairs, 2, size)  # [group, row, pair, block of the pair, bytes]
    scales = blocks[..., :head].reshape(groups, GROUP, pairs, 2, fields, 2).permute(0, 2, 4, 3, 1, 5)
    quants = blocks[..., head:].permute(0, 2, 1, 3, 4)  # [group, pair, row, block of the pair, bytes]
    if q.fmt.name == "Q8_0":
        quants = quants ^ 0x80
    pair = 4 * 2 * size
    data = torch.cat([scales.reshape(groups, pairs, 8 * head), quants.reshape(groups, pairs, 8 * (size - head))], -1)
    return QuantWeight(INTERLEAVED[q.fmt.name], data.reshape(groups, pairs * pair).contiguous(), q.rows, q.cols)


def rows_interleavable(weight: torch.Tensor) -> bool:
    """Whether a plain weight [O, I] can be laid out four rows at a time (`interleave_rows`)."""
    return weight.dim() == 2 and weight.shape[0] % GROUP == 0 and weight.shape[1] % BLOCK == 0


def interleave_rows(weight: torch.Tensor) -> torch.Tensor:
    """A plain weight [O, I] laid out as the kernels' PLAIN_X4 reads it, the same shape: per group of 4 rows, each
    row's values 0-31, then each row's 32-63, ..., so that a pass over 4 rows reads one stream (the Q8_0 and Q4_1
    layout of `interleave`, for values as they are)."""
    o, i = weight.shape
    return weight.reshape(o // GROUP, GROUP, i // BLOCK, BLOCK).transpose(1, 2).contiguous().view(o, i)


def rows_of_interleaved(weight: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all where None) of a weight laid out by `interleave_rows`, as plain rows [n, I]."""
    o, i = weight.shape
    groups = weight.view(o // GROUP, i // BLOCK, GROUP, BLOCK)
    if ids is None:
        return groups.transpose(1, 2).reshape(o, i)
    return groups[ids // GROUP, :, ids % GROUP, :].reshape(-1, i)


def _rows_of(q: QuantWeight, ids: torch.Tensor) -> QuantWeight:
    """Rows `ids` of an interleaved weight in the format it interleaves (`interleave`, undone)."""
    name = next(k for k, v in INTERLEAVED.items() if v == q.fmt)
    fields, size, head = FIELDS[name], q.fmt.block_bytes, 2 * FIELDS[name]
    pairs, n = q.cols // (2 * BLOCK), ids.numel()
    picked = q.data.reshape(-1, pairs, 8 * size)[ids // GROUP]  # [n, pair, bytes]: each id's group
    at, row = torch.arange(n), ids % GROUP
    # [n, pair, field, block, row, 2] at each id's row: [n, pair, field, block, 2], then fields after blocks
    scales = picked[..., : 8 * head].reshape(n, pairs, fields, 2, GROUP, 2)[at, :, :, :, row].transpose(2, 3)
    quants = picked[..., 8 * head :].reshape(n, pairs, GROUP, 2, size - head)[at, :, row]  # [n, pair, block, q]
    if name == "Q8_0":
        quants = quants ^ 0x80
    data = torch.cat([scales.reshape(n, pairs, 2, head), quants], dim=-1).reshape(n, q.cols // BLOCK * size)
    return QuantWeight(FORMATS[name], data, n, q.cols)


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """`weight` [rows, cols] (cols a multiple of 32) in llama.cpp's `fmt`, by gguf-py's reference quantizer."""
    if fmt not in FORMATS:
        raise ValueError(f"no weight format {fmt!r}: one of {', '.join(FORMATS)}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a weight of shape {tuple(weight.shape)}: quantized rows must be whole blocks of {BLOCK}")
    array = weight.detach().to(torch.float32).cpu().numpy()
    data = quants.quantize(array, GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(np.ascontiguousarray(data)), weight.shape[0], weight.shape[1])


def dequantize(q: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's values [rows, cols] (for the embedding rows a step looks up, and the tests' reference)."""
    if q.fmt.interleaved:
        q = q.take(slice(None))
    blocks = q.data.reshape(q.rows, q.cols // BLOCK, q.fmt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    if q.fmt.name == "Q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        packed = blocks[..., 4:] if q.fmt.name == "Q4_1" else blocks[..., 2:]
        nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # value j: byte j's low, 16 + j: high
        if q.fmt.name == "Q4_1":
            values = nibbles * d + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            values = (nibbles - 8) * d
    return values.reshape(q.rows, q.cols).to(dtype)


def quantized_bytes(params: int, fmt: str) -> float:
    """Bytes `params` weights take in `fmt` (the planner's bytes per weight)."""
    return params * FORMATS[fmt].block_bytes / BLOCK


def gguf_blocks(path: str | Path) -> dict[str, QuantWeight]:
    """The tensors of a GGUF file held in a block format the kernels read (Q8_0, Q4_0, Q4_1), by their GGUF
    names (blk.N.attn_q.weight...), as they ship: copied out of the file, not converted. Rows as stored (llama.cpp's
    converter permutes q's and k's rows for its rotary layout: `FusedDecoder.quantize` puts them back)."""
    blocks = {}
    for tensor in GGUFReader(str(path)).tensors:
        fmt = BY_TYPE.get(int(tensor.tensor_type))
        if fmt is None or len(tensor.shape) != 2:
            continue
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True)).reshape(rows, -1)
        if data.shape[1] != cols // BLOCK * fmt.block_bytes:
            raise ValueError(f"{tensor.name}: {data.shape[1]} bytes a row, not {cols // BLOCK * fmt.block_bytes}")
        blocks[tensor.name] = QuantWeight(fmt, data, rows, cols)
    return blocks


def unpermute(q: QuantWeight, heads: int) -> QuantWeight:
    """The rows of a q or k projection as transformers orders them, from the order llama.cpp's converter writes
    (convert_hf_to_gguf.py `LlamaModel.permute`: each head's two rotary halves interleaved); whole rows move, so the
    blocks are untouched."""
    data = q.data.reshape(heads, q.rows // heads // 2, 2, -1).transpose(1, 2).reshape(q.rows, -1).contiguous()
    return QuantWeight(q.fmt, data, q.rows, q.cols)
