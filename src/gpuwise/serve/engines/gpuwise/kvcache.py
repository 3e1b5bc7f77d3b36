"""The engine's KV cache, paged: keys and values in blocks of KV_BLOCK tokens, each sequence a table of the
blocks it holds (`PagedCache`, which transformers' forward and the fused decoder both write through), and the
blocks of recent prompts, shared with the prompts that start like them (`PrefixCache`).

Why paged (vLLM's PagedAttention, Kwon et al. SOSP 2023): a row per sequence as long as the longest one held 32
rows of 6,000 tokens for one long prompt among 31 short chats. Blocks are taken as a sequence grows and given
back as it ends, so the cache holds the tokens there are, to a block a sequence. The pool is one mapping of
the whole budget whose pages the OS gives only as blocks are first written, and the lowest free block is
always taken first: the memory resident is the most blocks ever held at once, not the budget."""

from __future__ import annotations

import heapq
import mmap
from collections import OrderedDict

import torch

from gpuwise.plan.memory import kv_bytes_per_token
from gpuwise.plan.serving import KV_BLOCK, kv_shape


class CacheFull(RuntimeError):
    """No free block: admission by the KV budget should make this impossible; it fails the pass, not the server."""


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple[torch.Tensor, object]:
    """A zeroed tensor whose memory is resident only where written: on a CPU an anonymous mapping of its own
    (torch.zeros writes every page; torch.empty may hand back a heap's old bytes, and a nan there, though masked,
    would reach the output through 0 x nan). Elsewhere torch.zeros. Returns the tensor and what keeps it alive."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    size = max(1, torch.Size(shape).numel()) * dtype.itemsize
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(memory, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)  # pages of 4 KiB, so that what is resident follows the blocks
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    return flat[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape), memory


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of `tensor`'s memory that are resident, counted page by page (Linux's /proc/self/pagemap: bit 63 of
    each page's entry says it is present), or None where that cannot be read. Of the paged cache's pool, whose
    pages the OS gives only as blocks are written (`_lazy_zeros`): what the KV cache takes of the server's memory.
    By page and not by mapping: neighbouring mappings of the same kind are merged into one in smaps."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page)
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(start * 8)
            entries = memoryview(f.read((end - start) * 8)).cast("Q")
    except (OSError, ValueError):
        return None
    return sum(e >> 63 for e in entries) * page


class PagedCache:
    """Keys in one [layers, blocks, block, kv_heads, head_dim] tensor, values in another; a sequence's position p
    is in block table[p // block], at p % block. Blocks are counted by reference: a prompt's full blocks may
    be held by the prefix cache and by every sequence that starts with that prompt at once, and are free when
    the last of them lets go.

    The model calls `update` from each attention layer (transformers' Cache contract); `bind` says beforehand
    which blocks the pass's rows hold (their tables), where it writes (positions) and how far it reads."""

    def __init__(self, config, blocks: int, dtype: torch.dtype, device, block: int = KV_BLOCK):
        self.layers, self.kv_heads, self.head_dim = kv_shape(config)
        self.blocks, self.block, self.dtype, self.device = blocks, block, dtype, device
        shape = (self.layers, blocks, block, self.kv_heads, self.head_dim)
        self.keys, self._keys_memory = _lazy_zeros(shape, dtype, device)
        self.values, self._values_memory = _lazy_zeros(shape, dtype, device)
        self._free = list(range(blocks))  # a heap: the lowest block first, so that few pages are ever touched
        self.refs = [0] * blocks
        self.peak = 0  # the most blocks held at once
        self.row_table = torch.zeros(0, 1, dtype=torch.long)  # `for_rows`' tables
        self.table = torch.zeros(0, 1, dtype=torch.long)
        self.pos = torch.zeros(0, 1, dtype=torch.long)
        self.length = 0
        self._write = torch.zeros(0, 1, dtype=torch.long)
        self._read: torch.Tensor | None = None

    @classmethod
    def for_rows(cls, config, rows: int, dtype: torch.dtype, device, context: int, block: int = KV_BLOCK):
        """A cache of `rows` sequences of up to `context` tokens, row i holding blocks i*per .. (i+1)*per - 1 in
        `row_table` [rows, per] (a forward pass outside the engine: load checks, tests, benchmarks)."""
        per = -(-context // block)
        cache = cls(config, rows * per, dtype, device, block)
        tables = [cache.allocate([], context) for _ in range(rows)]
        cache.row_table = torch.tensor(tables, dtype=torch.long)
        return cache

    # --- blocks ----------------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        return int(kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype.itemsize))

    @property
    def in_use(self) -> int:
        """Blocks held now (by sequences, the prefix cache, or both)."""
        return self.blocks - len(self._free)

    def allocate(self, table: list[int], tokens: int) -> list[int]:
        """Extend `table` (in place) with free blocks until it holds `tokens` positions; returns it."""
        while len(table) * self.block < tokens:
            if not self._free:
                raise CacheFull(f"the KV cache's {self.blocks:,} blocks of {self.block} tokens are all held")
            b = heapq.heappop(self._free)
            self.refs[b] = 1
            table.append(b)
        self.peak = max(self.peak, self.in_use)
        return table

    def share(self, blocks: list[int]) -> list[int]:
        """Another holder of `blocks` (already held): a new table that starts with them, nothing copied."""
        for b in blocks:
            self.refs[b] += 1
        return list(blocks)

    def free(self, table: list[int]) -> None:
        """Let go of a table's blocks (in place: it is empty after); a block no one holds is free."""
        for b in table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                heapq.heappush(self._free, b)
        table.clear()

    def tables(self, tables: list[list[int]]) -> torch.Tensor:
        """The block tables of a pass's rows as one [rows, widest] int64 tensor, short rows padded with their own
        last block (never read: a row reads its own positions only, and a mask hides the rest)."""
        width = max(1, max((len(t) for t in tables), default=1))
        return torch.tensor([t + [t[-1] if t else 0] * (width - len(t)) for t in tables], dtype=torch.long)

    def slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Where positions pos [n, q] of rows with block tables table [n, w] are in a layer's flat view."""
        return table.gather(1, pos // self.block) * self.block + pos % self.block

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values as [blocks * block, kv_heads, head_dim] views, indexed by `slots`."""
        shape = (self.blocks * self.block, self.kv_heads, self.head_dim)
        return self.keys[layer].view(shape), self.values[layer].view(shape)

    # --- a forward pass --------------------------------------------------------------------------------
    def bind(self, table: torch.Tensor, pos: torch.Tensor, length: int) -> None:
        """The next pass's rows: their block tables [n, w], the positions they write [n, q], and how many
        positions each reads (`length`, at most w * block)."""
        if length > table.shape[1] * self.block:
            raise ValueError(f"a pass reads {length} positions, its tables hold {table.shape[1] * self.block}")
        self.table, self.pos, self.length = table, pos, length
        self._write = self.slots(table, pos)
        self._read = None  # the gather index transformers' forward reads through: made when it first asks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__):
        k, v = self.flat(layer_idx)
        # [n, kv_heads, q, head_dim] in, stored as [n, q, kv_heads, head_dim] at each row's positions
        k[self._write] = key_states.transpose(1, 2).to(self.dtype)
        v[self._write] = value_states.transpose(1, 2).to(self.dtype)
        if self._read is None:
            reads = torch.arange(self.length, device=self.table.device).expand(self.table.shape[0], self.length)
            self._read = self.slots(self.table, reads)
        return k[self._read].transpose(1, 2), v[self._read].transpose(1, 2)

    # transformers asks these of a cache in some code paths; a 4-D mask and explicit positions skip most.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return self.layers


class PrefixCache:
    """The blocks of recent prompts, so that a prompt which starts like one of them (the same chat template,
    system prompt and earlier turns) runs only what differs: vLLM's automatic prefix caching. A prompt's full
    blocks are shared, not copied: the sequence's table starts with them, and it writes only past them.

    The key and value of a token depend only on the tokens before it (and on the LoRA adapter), so the
    longest common prefix with any stored prompt of the same adapter is reused, in whole blocks. Bounded by
    `tokens` in all; the least recently used prompt goes first (its blocks stay while a sequence holds them)."""

    def __init__(self, tokens: int, cache: PagedCache):
        self.tokens, self.held, self.cache = tokens, 0, cache
        self.entries: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()

    def longest(self, adapter: str | None, prompt: list[int]) -> tuple[int, tuple | None]:
        """(tokens of `prompt` stored, in whole blocks; the entry that holds them): at least the last token is
        left to run."""
        best, key, block = 0, None, self.cache.block
        for k, (tokens, _) in self.entries.items():
            if k[0] != adapter:
                continue
            n = min(len(tokens), len(prompt) - 1)
            same = next((i for i in range(n) if tokens[i] != prompt[i]), n) // block * block
            if same > best:
                best, key = same, k
        if key is not None:
            self.entries.move_to_end(key)
        return best, key

    def take(self, key: tuple, length: int) -> list[int]:
        """A table holding the entry's first `length` tokens (whole blocks), shared with it."""
        return self.cache.share(self.entries[key][1][: length // self.cache.block])

    def put(self, adapter: str | None, prompt: list[int], table: list[int]) -> None:
        """Keep a prompt's full blocks (its sequence's table holds them: they are shared)."""
        full = len(prompt) // self.cache.block
        stored = full * self.cache.block
        key = (adapter, tuple(prompt))
        if key in self.entries or not full or stored > self.tokens:
            return
        while self.held + stored > self.tokens:
            _, (_, blocks) = self.entries.popitem(last=False)
            self.held -= len(blocks) * self.cache.block
            self.cache.free(blocks)
        self.entries[key] = (prompt[:stored], self.cache.share(table[:full]))
        self.held += stored


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as the additive bias attention takes, in the model's dtype."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)
