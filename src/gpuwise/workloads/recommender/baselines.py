"""What the recommender is scored beside, on the same split in the same run: ItemKNN and EASE^R (the
popularity baseline is `RecommenderTraining.baseline`'s own). Both are closed forms over dense matrices, so they
are skipped past the recipe's dense bounds, and the summary says why instead of a figure."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gpuwise.workloads.recommender.recipe import RecommenderRecipe

# users -> [users, items] scores, in; the metrics of the top k of each test user, out
ScoreUsers = Callable[[Callable[[list[int]], torch.Tensor]], dict]


def neighbour_baselines(
    tu, ti, n_users: int, n_items: int, score_users: ScoreUsers, recipe: RecommenderRecipe = RecommenderRecipe()
) -> dict:
    """ItemKNN and EASE^R beside popularity: name -> metrics, or {"skipped": why} where they would not fit."""
    out: dict[str, dict] = {}
    lam = recipe.ease_lambda
    for name, side, fn in (
        ("ItemKNN (cosine)", n_items, lambda: item_knn(tu, ti, n_users, n_items, score_users)),
        (f"EASE^R (lambda {lam:g})", min(n_users, n_items), lambda: ease(tu, ti, n_users, n_items, score_users, lam)),
    ):
        if n_users * n_items > recipe.dense_cells or side > recipe.square_side:
            why = (
                f"{n_users:,} users x {n_items:,} items is past the dense bounds ({recipe.dense_cells:,} cells, "
                f"a square of side {recipe.square_side:,})"
            )
            out[name] = {"skipped": why}
        else:
            out[name] = fn()
    return out


def item_knn(tu, ti, n_users: int, n_items: int, score_users: ScoreUsers) -> dict:
    """Item-item cosine similarity over the training interactions; a user's score for an item is the
    sum of its similarities to the items the user has."""
    x = torch.zeros(n_users, n_items)
    x[torch.as_tensor(np.array(tu)), torch.as_tensor(np.array(ti))] = 1.0
    norm = x.sum(0).clamp(min=1).sqrt()
    sim = (x.T @ x) / norm[:, None] / norm[None, :]
    sim.fill_diagonal_(0)
    return score_users(lambda us: x[us] @ sim)


def ease(tu, ti, n_users: int, n_items: int, score_users: ScoreUsers, lam: float) -> dict:
    """EASE^R: the item-item weights B that best rebuild the user-item matrix X from itself, ridge-regularized,
    with a zero diagonal. Closed form: P = (X'X + lam I)^-1, B = I - P diag(1/diag P); scores S = X B."""
    scores = torch.from_numpy(ease_scores(tu, ti, n_users, n_items, lam))
    return score_users(lambda us: scores[us])


def ease_scores(tu, ti, n_users: int, n_items: int, lam: float) -> np.ndarray:
    """EASE^R's scores X B for every user, [users, items], in float64.

    Written out rather than taken from a library (none on PyPI is kept up for this one formula) and solved
    in the smaller of two equal forms: with fewer users than items (as on MovieLens) the items x items inverse
    is replaced, by Woodbury's identity, with a users x users one, far quicker (docs/quality.md):
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
