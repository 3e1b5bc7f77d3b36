"""Metrics shared by the workloads: binary classification (scikit-learn) and top-k ranking."""

from __future__ import annotations

import math

import numpy as np


def binary(probs: np.ndarray, labels: np.ndarray, threshold: float = 0.5) -> dict:
    from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score, roc_auc_score

    pred = (probs >= threshold).astype(int)
    tn, fp, fn, tp = confusion_matrix(labels, pred, labels=[0, 1]).ravel()
    out = {
        "accuracy": float((pred == labels).mean()),
        "f1": float(f1_score(labels, pred, zero_division=0)),
        "recall": float(recall_score(labels, pred, zero_division=0)),
        "precision": float(precision_score(labels, pred, zero_division=0)),
        "confusion": {"tn": int(tn), "fp": int(fp), "fn": int(fn), "tp": int(tp)},
        "threshold": threshold,
        "n": int(len(labels)),
    }
    out["roc_auc"] = float(roc_auc_score(labels, probs)) if len(set(labels.tolist())) == 2 else None
    return out


def ranking(top: list[list[int]], truth: list[set[int]], k: int) -> dict:
    """recall@k and NDCG@k (binary relevance), averaged over the users that have held-out items."""
    recalls, ndcgs = [], []
    for items, relevant in zip(top, truth, strict=True):
        if not relevant:
            continue
        hits = [1 if i in relevant else 0 for i in items[:k]]
        recalls.append(sum(hits) / len(relevant))
        dcg = sum(h / math.log2(r + 2) for r, h in enumerate(hits))
        ideal = sum(1 / math.log2(r + 2) for r in range(min(len(relevant), k)))
        ndcgs.append(dcg / ideal)
    n = len(recalls)
    return {
        f"recall@{k}": float(np.mean(recalls)) if n else 0.0,
        f"ndcg@{k}": float(np.mean(ndcgs)) if n else 0.0,
        "users": n,
    }
