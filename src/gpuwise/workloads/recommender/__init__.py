"""recommender: top-k recommendations from rating history, retrained every week.

The default model reads each user's latest items in order (SASRec: causal self-attention over the history,
Kang & McAuley 2018) and scores what comes next; `--model mf` trains matrix factorization (an embedding per
user, no order). The held-out split is each user's most recent 10 % of interactions: a single global cut-off
on MovieLens leaves too few users on both sides to tell models apart (docs/quality.md). ``--init-from``
starts from last week's run: known items keep their embeddings, new ones get fresh rows.

The package, by what each part does: `recipe` (the choices a variant may change: `RecommenderRecipe`),
`data` (interactions, the split, per-user histories and windows), `model`, `training` (losses, negatives,
`build`), `baselines` (ItemKNN, EASE^R), `warm_start` (`--init-from`) and `serving` (predict, the server).
`Recommender` below is the workload; a subclass with another `recipe` trains a variant of it
(`gpuwise train my_module:MyRecommender`, as benchmarks/recommender_ablation.py does).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads.base import BenchStep, OnnxSignature, Training, Workload, place
from gpuwise.workloads.recommender.baselines import ease, ease_scores, item_knn, neighbour_baselines
from gpuwise.workloads.recommender.data import (
    REQUIRED,
    TEST_SHARE,
    Interactions,
    latest,
    load_interactions,
    per_user,
    prepare,
    temporal_split,
    windows,
)
from gpuwise.workloads.recommender.model import (
    AllScores,
    CausalBlock,
    MatrixFactorization,
    Recommenders,
    SequentialRecommender,
    top_k,
)
from gpuwise.workloads.recommender.recipe import MODELS, RecommenderRecipe
from gpuwise.workloads.recommender.serving import (
    Item,
    RecommendRequest,
    RecommendResponse,
    Served,
    describe_model,
    load_trained,
    predict,
)
from gpuwise.workloads.recommender.training import (
    K,
    RecommenderTraining,
    bpr_loss,
    build,
    negatives,
    new_model,
    sequence_bpr_loss,
    sequence_softmax_loss,
    softmax_loss,
)
from gpuwise.workloads.recommender.warm_start import check_init_from, warm_start
from gpuwise.workloads.serving import Limits

__all__ = [
    "K", "MODELS", "REQUIRED", "TEST_SHARE", "AllScores", "CausalBlock", "Interactions", "Item",
    "MatrixFactorization", "RecommendRequest", "RecommendResponse", "Recommender", "RecommenderRecipe",
    "RecommenderTraining", "Recommenders", "Served", "SequentialRecommender", "bpr_loss", "build",
    "check_init_from", "describe_model", "ease", "ease_scores", "item_knn", "latest", "load_interactions",
    "load_trained", "negatives", "neighbour_baselines", "new_model", "per_user", "predict", "prepare",
    "sequence_bpr_loss", "sequence_softmax_loss", "softmax_loss", "temporal_split", "top_k", "warm_start",
    "windows",
]  # fmt: skip


class Recommender(Workload):
    """The recommender workload, trained by its `recipe` (a subclass may name another)."""

    name = "recommender"
    summary = "top-k recommendations from rating history (MovieLens), retrained every week"
    options = ("init_from", "model")
    inputs = "user ids"
    onnx = OnnxSignature("users", "scores", ("ids.json", "model.safetensors"))
    recipe: ClassVar[RecommenderRecipe] = RecommenderRecipe()

    def build(self, cfg, run_dir: Path) -> Training:
        return build(cfg, run_dir, self.recipe)

    def validate(self, cfg) -> None:
        if cfg.model is not None and cfg.model not in MODELS:
            raise GpuwiseError(f"--model must be one of {', '.join(MODELS)}, not '{cfg.model}'")

    def check_files(self, cfg) -> None:
        if cfg.init_from:
            with loading_model(Path(cfg.init_from), "--init-from"):
                check_init_from(Path(cfg.init_from), cfg.model or MODELS[0])

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        """The default model on MovieLens' shapes (671 users, 9,066 movies): `batch` windows of the recipe's
        history."""
        batch, history = batch or 128, self.recipe.history
        model = place(SequentialRecommender(9066, history, self.recipe.dropout), device)
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(1, 9067, (batch, history), generator=g).to(device)
        target = torch.randint(0, 9066, (batch, history), generator=g).to(device)
        return BenchStep(model, lambda: sequence_softmax_loss(model, seq, target, history), batch, None)

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
