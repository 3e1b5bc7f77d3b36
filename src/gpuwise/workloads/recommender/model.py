"""The recommender's models: matrix factorization (an embedding per user, no order) and SASRec (causal
self-attention over a user's latest items, Kang & McAuley 2018), and the one forward a server makes."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class MatrixFactorization(nn.Module):
    def __init__(self, users: int, items: int, dim: int = 64):
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.item = nn.Embedding(items, dim)
        self.bias = nn.Embedding(items, 1)
        nn.init.normal_(self.user.weight, std=0.05)
        nn.init.normal_(self.item.weight, std=0.05)
        nn.init.zeros_(self.bias.weight)

    def forward(self, users: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of (user, item) pairs, or of every item for each user when `items` is None. The catalogue
        is looked up through the embeddings' own forward, not `.weight`: under FSDP only a module call
        gathers the sharded table."""
        if items is None:
            every = torch.arange(self.item.num_embeddings, device=users.device)
            return self.user(users) @ self.item(every).T + self.bias(every).T
        return (self.user(users) * self.item(items)).sum(-1) + self.bias(items).squeeze(-1)

    def all_scores(self, users: torch.Tensor) -> torch.Tensor:
        """`forward(users)` read straight from the tables, for whole (unsharded) weights: evaluation, serving,
        the ONNX graph."""
        return self.user(users) @ self.item.weight.T + self.bias.weight.T


class CausalBlock(nn.Module):
    """Pre-norm self-attention and MLP (GPT-2's block): position t attends to the items up to t only, so
    every position of a window is trained to predict the item after it. LayerNorm, not BatchNorm: a
    sample's output never depends on the rest of its micro-batch."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.norm2(x)))


class SequentialRecommender(nn.Module):
    """SASRec: item embeddings plus learned positions through causal self-attention blocks; the hidden state
    after a history, dotted with every item's embedding (the same table as the input's) plus a bias, scores
    the next item. Inputs are item index + 1, with 0 for "no item": a history shorter than `history` is
    padded on the left. SASRec's two blocks, in width 64 as two heads of 32 (the paper: one head of 50).
    Dropout draws its masks from torch's generator: a resumed run redraws them exactly, but another number
    of processes or another micro-batch draws others."""

    def __init__(self, items: int, history: int, dropout: float, dim: int = 64, layers: int = 2, heads: int = 2):
        super().__init__()
        self.dim = dim
        self.item = nn.Embedding(items + 1, dim, padding_idx=0)
        self.bias = nn.Embedding(items + 1, 1)
        self.pos = nn.Embedding(history, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        for table in (self.item, self.pos):
            nn.init.normal_(table.weight, std=0.02)
        with torch.no_grad():
            self.item.weight[0].zero_()
        nn.init.zeros_(self.bias.weight)

    @property
    def history(self) -> int:
        return self.pos.num_embeddings

    def hidden(self, seq: torch.Tensor) -> torch.Tensor:
        """[batch, history] item ids (+1) -> [batch, history, dim]: the state after each position."""
        positions = torch.arange(seq.shape[1], device=seq.device)
        # scaled by sqrt(dim) as in the Transformer, so the N(0, 0.02) embeddings are not drowned by positions
        x = self.drop(self.item(seq) * self.dim**0.5 + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, seq: torch.Tensor, items: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
        """Every item's score after each position, [batch, history, items], or after the whole history only
        (`last`: [batch, items]); or, given `items` [batch, history, n] (index + 1), those items' scores. The
        catalogue is looked up through the embeddings' own forward: under FSDP only a module call gathers the
        sharded table, and the attention blocks, sharded one by one, gather theirs in their own forward."""
        h = self.hidden(seq)
        if last:
            h = h[:, -1]
        if items is None:
            every = torch.arange(1, self.item.num_embeddings, device=seq.device)
            return h @ self.item(every).T + self.bias(every).T
        return (h.unsqueeze(2) * self.item(items)).sum(-1) + self.bias(items).squeeze(-1)

    def all_scores(self, seq: torch.Tensor) -> torch.Tensor:
        """[batch, items]: every item's score after each whole history (evaluation, serving, the ONNX graph).
        Through forward, sharded or not: the blocks' own forward is where FSDP gathers their weights."""
        return self(seq, last=True)


Recommenders = MatrixFactorization | SequentialRecommender


class AllScores(nn.Module):
    """users -> scores for every item: the one forward a recommender server makes (and exports). For the
    sequential model the users' latest items ride along as a buffer, so the graph's input stays user ids."""

    history: torch.Tensor | None

    def __init__(self, model: Recommenders, history: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.register_buffer("history", history, persistent=False)

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return self.model.all_scores(users if self.history is None else self.history[users])


def top_k(scores: torch.Tensor, seen: list[np.ndarray], k: int) -> list[list[int]]:
    """Each row's k best items, leaving out that row's `seen` ones."""
    scores = scores.clone()
    for row, items in enumerate(seen):
        scores[row, torch.from_numpy(items)] = -torch.inf
    return scores.topk(k, dim=1).indices.tolist()
