"""The engine's KV caches: a row of keys and values per running sequence (`SlotCache`, which transformers'
forward and the fused decoder both write through), and recent prompts' keys and values for the prompts that
start like them (`PrefixCache`)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from gpuwise.plan.memory import kv_bytes_per_token
from gpuwise.plan.serving import kv_shape


class SlotCache:
    """The KV cache of the running sequences: keys in one [layers, slots, capacity, kv_heads, head_dim]
    tensor, values in another, running sequence i in row i (rows 0..n-1 in use, kept compact). It grows its
    capacity by doubling, up to the model's context, so memory follows the longest sequence. One tensor
    for all layers, so that moving a row, or copying a cached prompt prefix into one, is one copy.

    The model calls `update` from each attention layer (transformers' Cache contract); `bind` says
    beforehand where this forward pass writes (rows, positions) and how far it reads."""

    def __init__(self, config, slots: int, dtype: torch.dtype, device, context: int, start: int = 256):
        self.layers, self.kv_heads, self.head_dim = kv_shape(config)
        self.slots, self.dtype, self.device, self.context = slots, dtype, device, context
        self.capacity = 0
        self.keys = self.values = torch.zeros(0)
        self._grow(min(start, context))
        self.rows = slice(0, 0)
        self.index = torch.zeros(0, 1, dtype=torch.long)
        self.pos = torch.zeros(0, 1, dtype=torch.long)
        self.length = 0

    def bytes_per_token(self) -> int:
        return int(kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype.itemsize))

    def _grow(self, capacity: int) -> None:
        shape = (self.layers, self.slots, capacity, self.kv_heads, self.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            keys[:, :, : self.capacity] = self.keys
            values[:, :, : self.capacity] = self.values
        self.keys, self.values, self.capacity = keys, values, capacity

    def reserve(self, length: int) -> None:
        if length > self.capacity:
            self._grow(min(self.context, max(2 * self.capacity, length)))

    def bind(self, first: int, pos: torch.Tensor, length: int) -> None:
        n = pos.shape[0]
        self.rows = slice(first, first + n)
        self.index = torch.arange(first, first + n, device=self.device).unsqueeze(1)
        self.pos, self.length = pos, length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_, **__):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        # [n, kv_heads, q, head_dim] in, stored as [n, q, kv_heads, head_dim] at each row's positions
        k[self.index, self.pos] = key_states.transpose(1, 2).to(self.dtype)
        v[self.index, self.pos] = value_states.transpose(1, 2).to(self.dtype)
        return k[self.rows, : self.length].transpose(1, 2), v[self.rows, : self.length].transpose(1, 2)

    def move(self, src: int, dst: int, length: int) -> None:
        self.keys[:, dst, :length] = self.keys[:, src, :length]
        self.values[:, dst, :length] = self.values[:, src, :length]

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange two rows' first positions (row a holds `length_a` of them, row b `length_b`)."""
        keys, values = self.read(a, length_a)
        self.move(b, a, length_b)
        self.write(b, keys, values)

    def read(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one row's first `length` positions, keys and values: [layers, length, kv_heads, head_dim]."""
        return self.keys[:, row, :length].clone(), self.values[:, row, :length].clone()

    def write(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The inverse of `read`: positions 0..len-1 of `row` (capacity reserved beforehand)."""
        self.keys[:, row, : keys.shape[1]] = keys
        self.values[:, row, : values.shape[1]] = values

    # transformers asks these of a cache in some code paths; a 4-D mask and explicit positions skip most.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def __len__(self) -> int:
        return self.layers


class PrefixCache:
    """The keys and values of recent prompts, so that a prompt which starts like one of them (the same chat
    template, system prompt and earlier turns) runs only what differs: the automatic prefix caching of vLLM
    and SGLang, here at token granularity over whole prompts rather than over blocks.

    The key and value of a token depend only on the tokens before it (and on the LoRA adapter), so the
    longest common prefix with any stored prompt of the same adapter is reused as stored. Bounded by
    `tokens` in all; the least recently used prompt goes first."""

    def __init__(self, tokens: int):
        self.tokens, self.held = tokens, 0
        self.entries: OrderedDict[tuple, tuple[list[int], torch.Tensor, torch.Tensor]] = OrderedDict()

    def longest(self, adapter: str | None, prompt: list[int]) -> tuple[int, tuple | None]:
        """(tokens of `prompt` stored, the entry that holds them); at least the last token is left to run."""
        best, key = 0, None
        for k, (tokens, _, _) in self.entries.items():
            if k[0] != adapter:
                continue
            n = min(len(tokens), len(prompt) - 1)
            same = next((i for i in range(n) if tokens[i] != prompt[i]), n)
            if same > best:
                best, key = same, k
        if key is not None:
            self.entries.move_to_end(key)
        return best, key

    def get(self, key: tuple, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, keys, values = self.entries[key]
        return keys[:, :length], values[:, :length]

    def put(self, adapter: str | None, prompt: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        key = (adapter, tuple(prompt))
        if key in self.entries or len(prompt) > self.tokens:
            return
        while self.held + len(prompt) > self.tokens:
            old, _, _ = self.entries.popitem(last=False)[1]
            self.held -= len(old)
        self.entries[key] = (prompt, keys, values)
        self.held += len(prompt)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as the additive bias attention takes, in the model's dtype."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)
