"""A finished recommender run, loaded to recommend: `predict` for the CLI, `Served` behind POST /v1/recommend
(a user in, the top k items out). What the model is and how long a history it reads come from the run's
ids.json, never from the loading code's recipe, so runs trained under another recipe load as trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field

from gpuwise.workloads.recommender.data import latest, per_user
from gpuwise.workloads.recommender.model import AllScores, MatrixFactorization, SequentialRecommender, top_k
from gpuwise.workloads.serving import ClientError, Limits, ServeContext, Text, run_forward


def load_trained(run_dir: Path) -> tuple[AllScores, dict, list[np.ndarray]]:
    """(users -> every item's score, ids.json, each user's training items oldest first) of a finished run.
    A run without ids.json's "model" is matrix factorization (trained before the sequential model)."""
    from safetensors.torch import load_model

    meta = json.loads((run_dir / "ids.json").read_text())
    inter = np.load(run_dir / "train_interactions.npz")
    seen = per_user(inter["user"], inter["item"], len(meta["users"]))
    if meta.get("model", "mf") == "sasrec":
        # dropout 0: the loaded model only scores (eval mode draws no masks either way)
        sasrec = SequentialRecommender(len(meta["items"]), meta["history"], 0.0, dim=meta["dim"])
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
    """Each user's top k unseen items by the model, or the most popular ones for a user it has not seen."""
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
