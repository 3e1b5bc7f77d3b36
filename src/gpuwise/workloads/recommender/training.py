"""The recommender's training side: losses, sampled negatives, and `build`, which hands the training loop
the bound methods of one `RecommenderTraining`.

Both models train with a softmax over the whole catalogue (the next item against every other item) or,
past the recipe's `full_softmax_items`, with BPR (against one sampled negative)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads import metrics
from gpuwise.workloads.base import Training, whole_params
from gpuwise.workloads.recommender.baselines import neighbour_baselines
from gpuwise.workloads.recommender.data import Interactions, latest, load_interactions, prepare, windows
from gpuwise.workloads.recommender.model import (
    AllScores,
    MatrixFactorization,
    Recommenders,
    SequentialRecommender,
    top_k,
)
from gpuwise.workloads.recommender.recipe import MODELS, RecommenderRecipe
from gpuwise.workloads.recommender.warm_start import warm_start

K = 10  # recall@K, NDCG@K


def softmax_loss(model, users, pos):
    """Cross-entropy of each interaction's item among all items (fp32 logits under bf16 autocast)."""
    return nn.functional.cross_entropy(model(users).float(), pos)


def bpr_loss(model, users, pos, neg):
    """BPR in one forward over positives and negatives together: one call per step (a module called
    twice is one that torch's MemTracker, behind the traced planner, cannot follow)."""
    scores = model(torch.cat([users, users]), torch.cat([pos, neg]))
    s_pos, s_neg = scores.chunk(2)
    return -nn.functional.logsigmoid(s_pos - s_neg).mean()


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


def new_model(kind: str, data: Interactions, recipe: RecommenderRecipe) -> Recommenders:
    """The `--model` to train, freshly initialized for this data's users and items."""
    if kind == "sasrec":
        return SequentialRecommender(len(data.items), recipe.history, recipe.dropout)
    return MatrixFactorization(len(data.users), len(data.items))


class RecommenderTraining:
    """One run's training side, built once per run: its samples (windows of each user's items for the
    sequential model, single interactions for matrix factorization), its loss, and how it is scored and
    saved. `build` hands its bound methods to the loop; nothing here changes after construction."""

    def __init__(self, kind: str, seed: int, data: Interactions, recipe: RecommenderRecipe):
        self.kind, self.seed, self.data, self.recipe = kind, seed, data, recipe
        self.softmax = len(data.items) <= recipe.full_softmax_items
        histories = data.histories
        self.seen = [np.sort(h) for h in histories]
        if kind == "sasrec":
            self.inputs, self.targets = windows(histories, recipe.history)
            self.history = latest(histories, recipe.history)
            self.per_window = float((self.targets >= 0).sum() / max(1, len(self.targets)))
            if not len(self.inputs):
                raise GpuwiseError(
                    f"{data.source}: no user has two training interactions: nothing to learn an order from"
                )

    @property
    def train_size(self) -> int:
        return len(self.inputs) if self.kind == "sasrec" else len(self.data.user)

    def make_batch(self, indices: Sequence[int], epoch: int) -> dict:
        idx, n_items = np.asarray(indices), len(self.data.items)
        if self.kind == "sasrec":
            batch = {"seq": torch.from_numpy(self.inputs[idx]), "target": torch.from_numpy(self.targets[idx])}
            if not self.softmax:  # one negative per position, hashed from (window, position)
                h = self.recipe.history
                at = idx[:, None] * h + np.arange(h)[None, :]
                batch["neg"] = torch.from_numpy(negatives(at.ravel(), self.seed, epoch, n_items).reshape(at.shape))
            return batch
        batch = {"user": torch.from_numpy(self.data.user[idx]), "pos": torch.from_numpy(self.data.item[idx])}
        if not self.softmax:
            batch["neg"] = torch.from_numpy(negatives(idx, self.seed, epoch, n_items))
        return batch

    def loss(self, model, batch: dict):
        if self.kind == "sasrec":
            if self.softmax:
                return sequence_softmax_loss(model, batch["seq"], batch["target"], self.per_window)
            return sequence_bpr_loss(model, batch["seq"], batch["target"], batch["neg"], self.per_window)
        if self.softmax:
            return softmax_loss(model, batch["user"], batch["pos"])
        return bpr_loss(model, batch["user"], batch["pos"], batch["neg"])

    def score_users(self, score_fn: Callable[[list[int]], torch.Tensor]) -> dict:
        """recall@K and NDCG@K of the top K unseen items by `score_fn` (test users -> [users, items])."""
        tops: list[list[int]] = []
        users = self.data.test_users
        for start in range(0, len(users), 256):
            chunk = users[start : start + 256]
            tops += top_k(score_fn(chunk), [self.seen[u] for u in chunk], K)
        return metrics.ranking(tops, self.data.truth, K)

    @torch.no_grad()
    def evaluate(self, model, device) -> dict:
        model.eval()
        raw = model.module if hasattr(model, "module") else model
        scorer = AllScores(raw, self.history.to(device) if self.kind == "sasrec" else None)
        # matrix factorization reads its tables outside forward, which FSDP does not gather by itself
        with whole_params(raw) if self.kind == "mf" else contextlib.nullcontext():
            out = self.score_users(lambda us: scorer(torch.tensor(us, device=device)).float().cpu())
        model.train()
        return out

    def baseline(self) -> dict:
        """Popularity, and beside it ItemKNN and EASE^R, on the same split."""
        d = self.data
        pop = torch.from_numpy(d.popularity)
        out = {"name": "popularity", **self.score_users(lambda us: pop.expand(len(us), -1))}
        out["also"] = neighbour_baselines(d.user, d.item, len(d.users), len(d.items), self.score_users, self.recipe)
        return out

    def save(self, model, run_dir: Path) -> list[str]:
        from safetensors.torch import save_model

        d = self.data
        save_model(model, str(run_dir / "model.safetensors"))
        meta = {
            "model": self.kind,
            "users": d.users,
            "items": d.items,
            "titles": d.titles,
            "popular": np.argsort(-d.popularity, kind="stable")[:100].tolist(),
            "dim": model.item.embedding_dim,
        }
        if self.kind == "sasrec":
            meta["history"] = self.recipe.history  # what a loaded run reads, whatever the loading code's recipe
        (run_dir / "ids.json").write_text(json.dumps(meta))
        # oldest first within each user: the sequential model reads each user's latest items from it
        np.savez_compressed(run_dir / "train_interactions.npz", user=d.user, item=d.item)
        return ["model.safetensors", "ids.json", "train_interactions.npz"]

    def defaults(self) -> dict:
        """Epochs, batch size and learning rate: the best the ablation found (docs/quality.md, recommender)."""
        if self.kind == "sasrec":  # no weight decay (SASRec's MovieLens setting): dropout regularizes
            return {"epochs": 30, "batch_size": 128, "lr": 3e-3, "weight_decay": 0.0}
        return {
            "epochs": 5 if self.softmax else 20,
            "batch_size": 1024,
            "lr": 1e-2 if self.softmax else 5e-3,
            "weight_decay": 1e-4,
        }

    def info(self, warm: dict | None) -> dict:
        """What the summary says about the data, the model and the loss (`warm`: warm_start's counts)."""
        d, n = self.data, len(self.data.items)
        out = {
            "data": d.source,
            "interactions": d.size,
            "train": d.train_size,
            "test": d.test_size,
            "users": len(d.users),
            "items": n,
            "test_users": len(d.test_users),
            "split": "each user's most recent 10 % held out",
            "model": (
                f"SASRec: self-attention over each user's latest {self.recipe.history} items, a sample is a window"
                " of them"
                if self.kind == "sasrec"
                else "matrix factorization: an embedding per user and per item, a sample is one interaction"
            ),
            "loss": (
                f"softmax over all {n:,} items"
                if self.softmax
                else f"BPR, one sampled negative ({n:,} items: past {self.recipe.full_softmax_items:,} for a full"
                " softmax)"
            ),
        }
        if warm:
            out["warm_start"] = warm
        return out


def build(cfg, run_dir: Path, recipe: RecommenderRecipe = RecommenderRecipe()) -> Training:
    """The training side of one run: data split and indexed, the model (warm-started from `--init-from`),
    the baselines scored, and the loop's callbacks bound to a `RecommenderTraining`."""
    kind = cfg.model or MODELS[0]
    data = prepare(*load_interactions(cfg.data))
    model = new_model(kind, data, recipe)
    warm = None
    if cfg.init_from:
        with loading_model(Path(cfg.init_from), "--init-from"):
            warm = warm_start(model, Path(cfg.init_from), data.users, data.items)
    run = RecommenderTraining(kind, cfg.seed, data, recipe)
    return Training(
        "recommender",
        model,
        run.train_size,
        run.make_batch,
        run.loss,
        run.evaluate,
        run.save,
        defaults=run.defaults(),
        baseline=run.baseline(),
        info=run.info(warm),
    )
