"""A defects run as the training loop sees it: `DefectsRun` holds the run's cells, model and recipe, and its
bound methods are the `Training`'s batches, loss, evaluation and save."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError, loading_model
from gpuwise.workloads import metrics
from gpuwise.workloads.base import Training
from gpuwise.workloads.defects.data import choose_threshold, load_cells, to_tensor
from gpuwise.workloads.defects.model import (
    MultiScale,
    SymmetricViews,
    for_inference,
    predict_proba,
    recorded_layout,
    save_weights,
)
from gpuwise.workloads.defects.recipe import DefectsRecipe, augment, mixup_partners, part_name

# Deitsch et al.'s CNN decides for its likelier class: the rule of accuracy@0.5
PUBLISHED = {"accuracy@0.5": 0.8842, "source": "Deitsch et al., Solar Energy 2019 (arXiv 1807.02894)"}


def assemble(run_dir: Path, cfg, recipe: DefectsRecipe) -> tuple[MultiScale, dict]:
    """The run's CNNs loaded from their members' finished runs (RUN/parts/NAME), and what each reached."""
    from safetensors.torch import load_model

    kinds, reached, names = set(), {}, [part_name(size, seed) for size, seed in recipe.cnns(cfg)]
    for name in names:
        part = run_dir / "parts" / name
        with loading_model(part):
            kinds.add(recorded_layout(json.loads((part / "labels.json").read_text()), part)[:2])
            e = json.loads((part / "summary.json").read_text())
            reached[name] = {k: e["eval"].get(k) for k in ("accuracy@0.5", "roc_auc", "recall")}
            reached[name]["wall_s"] = e["wall_s"]
    if len(kinds) != 1:
        raise GpuwiseError(f"{run_dir / 'parts'}: the members' convolutions or pooling differ ({sorted(kinds)})")
    ((standardized, pool),) = kinds
    model = MultiScale(recipe.sizes(cfg), standardized=standardized, pool=pool)
    for member, name in zip(model.members, names, strict=True):
        with loading_model(run_dir / "parts" / name):
            load_model(member, str(run_dir / "parts" / name / "model.safetensors"))
    return model, reached


class DefectsRun:
    """One run: its cells, its model and the recipe it trains by. `training()` hands the loop its bound
    methods; the threshold `evaluate` chooses on the validation cells is the one `save` records.
    `new_model(cfg)`: the fresh model of a run of one network (an assembled run loads its parts instead)."""

    def __init__(self, cfg, run_dir: Path, recipe: DefectsRecipe, new_model: Callable[[Any], nn.Module]):
        self.cfg, self.recipe = cfg, recipe
        self.sizes = recipe.sizes(cfg)
        self.size = max(self.sizes)  # smaller members resize it down in their forward
        self.cells = load_cells(cfg.data, self.size, recipe.soft_targets)
        self.assembled = len(self.sizes) > 1
        self.parts: dict = {}
        self.model: nn.Module
        if self.assembled:  # its members trained apart, as runs of their own (`parts`); this run assembles them
            self.model, self.parts = assemble(run_dir, cfg, recipe)
        else:
            self.model = new_model(cfg)
        # multiscale: each member's own loss, averaged (its logits, one column per member)
        self.forward_kw = {"members": True} if isinstance(self.model, MultiScale) else {}
        self.threshold = 0.5

    def make_batch(self, indices, epoch: int) -> dict:
        c, seed = self.cells, self.cfg.seed
        x, y = augment(c.x_train[indices], indices, seed, epoch, self.recipe), c.t_train[indices]
        if self.recipe.mixup:
            x, y = self.mixup(x, y, indices, epoch)
        return {"x": to_tensor(x), "y": torch.from_numpy(y).float()}

    def mixup(self, x: np.ndarray, y: np.ndarray, indices, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Each image blended with its partner (flipped and turned by seed + 1), the targets alike."""
        c, seed = self.cells, self.cfg.seed
        partners, w = mixup_partners(indices, seed, epoch, len(c.x_train), self.recipe)
        other = augment(c.x_train[partners], partners, seed + 1, epoch, self.recipe).astype(np.float32)
        mixed = w[:, None, None] * x.astype(np.float32) + (1 - w[:, None, None]) * other
        return mixed, w * y + (1 - w) * c.t_train[partners]

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["x"], **self.forward_kw).float()
        return nn.functional.binary_cross_entropy_with_logits(
            logits, batch["y"].view(-1, *[1] * (logits.dim() - 1)).expand_as(logits)
        )

    def evaluate(self, model: nn.Module, device) -> dict:
        """The threshold from the validation cells, then the test cells at it (and at 0.5, for the record)."""
        c = self.cells
        model = for_inference(model) if not self.cfg.base else model
        model = SymmetricViews(model) if self.recipe.views == 8 else model
        self.threshold, why = choose_threshold(predict_proba(model, c.x_val, device), c.y_val)
        probs = predict_proba(model, c.x_test, device)
        out = metrics.binary(probs, c.y_test, self.threshold)
        at_half = metrics.binary(probs, c.y_test)
        return out | {"threshold_origin": why, "accuracy@0.5": at_half["accuracy"], "recall@0.5": at_half["recall"]}

    def save(self, model: nn.Module, run_dir: Path) -> list[str]:
        cfg, r = self.cfg, self.recipe
        meta = {
            "classes": self.cells.info["classes"],
            "image_size": self.size,
            "base": cfg.base,
            "views": r.views,
            "threshold": self.threshold,
        }
        if not cfg.base:  # how to rebuild it (`recorded_layout`): older runs lack these keys
            meta |= {"weight_standardization": r.weight_standardization, "pool": r.pool, "sizes": list(self.sizes)}
        (run_dir / "labels.json").write_text(json.dumps(meta, indent=1))
        return ["labels.json", *save_weights(model, run_dir)]

    def baseline(self) -> dict:
        """Every test cell called the training cells' majority class."""
        c = self.cells
        majority = int(np.bincount(c.y_train, minlength=2).argmax())
        baseline = {"name": "majority class", **metrics.binary(np.full(len(c.y_test), float(majority)), c.y_test)}
        return baseline | {"roc_auc": 0.5, "accuracy@0.5": baseline["accuracy"], "recall@0.5": baseline["recall"]}

    def training(self) -> Training:
        parts = {"parts": self.parts} if self.assembled else {}
        return Training(
            "defects",
            self.model,
            self.cells.counts["train"],
            self.make_batch,
            self.loss,
            self.evaluate,
            self.save,
            defaults=self.recipe.defaults(self.assembled),
            baseline=self.baseline(),
            info=self.cells.info | parts | self.cells.counts | {"published": dict(PUBLISHED)},
            steps=0 if self.assembled else None,
        )
