"""`--init-from LAST_WEEK_RUN`: this week's model starts from last week's weights, matched by id."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.recommender.model import MatrixFactorization, Recommenders, SequentialRecommender


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
    other weights (positions, attention) are copied whole. Returns how many rows were kept and new."""
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
