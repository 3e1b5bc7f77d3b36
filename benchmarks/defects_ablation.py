"""What each lever buys the defects workload on ELPV: one full training run per variant, in fresh processes
one after another, each scored on the same test cells.

Run: .venv/bin/python benchmarks/defects_ablation.py [--variants default,plain-conv,...|all] [--seed 0]

Variants (each the default run, `gpuwise train defects`, with one change); without --variants, the first five:
  default      weight-standardized convolutions, GeM pooling, hard labels, flips and 90-degree turns, 8 test-time
               views, threshold from the validation cells
  plain-conv   plain convolutions (DefectsRecipe(weight_standardization=False), as older runs)
  20-epochs    --epochs 20
  soft         ELPV's own defect probabilities (0, 1/3, 2/3, 1) as targets instead of 0/1 (soft_targets=True)
  jitter       brightness and contrast jitter of +-20 % on top of the flips and turns (jitter=0.2)
  crop         a random square crop of 80-100 % of the side, resized back, after the flips (crop=0.2)
  wide         1.5x the channels in every stage: 48, 96, 192, 384 (0.9 M parameters instead of 0.4 M)
  double       two convolutions per stage instead of one
  per-image    each image standardized to zero mean and unit variance (train and test) instead of a fixed scale
  lr-1e-3      --lr 1e-3 (the default 2e-3)
  lr-4e-3      --lr 4e-3
  192px-60     --image-size 192 --epochs 60 (~9 minutes)
  256px        --image-size 256 (~10 minutes)
  300px        --image-size 300, ELPV's own size (~12 minutes)
  soft-192px-60  soft targets, --image-size 192 --epochs 60
  mixup        mixup: each training image blended with another training image (after both are flipped and
               turned), the targets alike, weight ~ Beta(0.2, 0.2), the image's own share the larger (mixup=0.2)
  mixup-0.4    mixup with Beta(0.4, 0.4)
  mixup-192px-60  mixup 0.2, --image-size 192 --epochs 60
  avg-pool     the last map averaged instead of GeM-pooled (pool="avg", as older runs)
  one-view     the test and validation cells scored on the image alone, not averaged over its 8 flips and
               turns (views=1, as older runs)
  192px-60-gem  --image-size 192 --epochs 60, with the default GeM pooling and 8 views (~10 minutes)
  multiscale   --model multiscale: two CNNs trained apart, at 128 px for 40 epochs and at 192 px for 60, each a
               run of its own; the mean of their probabilities (~12 minutes)
  multiscale-40  the same, both for 40 epochs (~10 minutes)
  ensemble     --model ensemble: three CNNs at 192 px, 60 epochs, seeds N to N+2, trained apart; the mean of
               their probabilities (~26 minutes)

A variant of the recipe is a `Defects` subclass below with another `DefectsRecipe` (or, for the network's
shape, another `new_model`), trained by its `module:Class` name (`gpuwise train defects_ablation:Jitter`, this
directory on the Python path). Per variant: accuracy, recall and precision of "defective" at the threshold
chosen on the validation cells, accuracy and recall at 0.5 (the published figure's rule), ROC-AUC, and the
run's wall time (minutes above: 2 CPU cores). A difference of a point or so between two variants is within
what another seed moves (run it with --seed 1 and 2 to see); the figures are in docs/quality.md, defects.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ablation import main, train_child
from torch import nn

from gpuwise.workloads.defects import DefectCNN, Defects, DefectsRecipe

HERE = Path(__file__).resolve().parent
MODULE = Path(__file__).stem  # how the child imports this file: it runs as __main__ here


class PlainConv(Defects):
    recipe = DefectsRecipe(weight_standardization=False)


class Soft(Defects):
    recipe = DefectsRecipe(soft_targets=True)


class Jitter(Defects):
    recipe = DefectsRecipe(jitter=0.2)


class Crop(Defects):
    recipe = DefectsRecipe(crop=0.2)


class Mixup(Defects):
    recipe = DefectsRecipe(mixup=0.2)


class Mixup04(Defects):
    recipe = DefectsRecipe(mixup=0.4)


class AvgPool(Defects):
    recipe = DefectsRecipe(pool="avg")


class OneView(Defects):
    recipe = DefectsRecipe(views=1)


# The network's shape is not a recipe field: a run of these does not record it, so it trains and is scored
# here but would not load again.
class Wide(Defects):
    def new_model(self, cfg) -> nn.Module:
        r = self.recipe
        return DefectCNN(channels=(48, 96, 192, 384), standardized=r.weight_standardization, pool=r.pool)


class Double(Defects):
    def new_model(self, cfg) -> nn.Module:
        return DefectCNN(double=True, standardized=self.recipe.weight_standardization, pool=self.recipe.pool)


class Standardized(nn.Module):
    """The model fed each image standardized to zero mean and unit variance, in training and scoring alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = x.mean(dim=(1, 2, 3), keepdim=True), x.std(dim=(1, 2, 3), keepdim=True)
        return self.model((x - mean) / (std + 1e-3))


class PerImage(Defects):
    def new_model(self, cfg) -> nn.Module:
        return Standardized(super().new_model(cfg))


def _named(workload: type[Defects]) -> str:
    return f"{MODULE}:{workload.__name__}"


RUNS_192_60 = ["--image-size", "192", "--epochs", "60"]
# name: (the workload trained, train flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "default": ("defects", []),
    "plain-conv": (_named(PlainConv), []),
    "20-epochs": ("defects", ["--epochs", "20"]),
    "soft": (_named(Soft), []),
    "jitter": (_named(Jitter), []),
    "crop": (_named(Crop), []),
    "wide": (_named(Wide), []),
    "double": (_named(Double), []),
    "per-image": (_named(PerImage), []),
    "lr-1e-3": ("defects", ["--lr", "1e-3"]),
    "lr-4e-3": ("defects", ["--lr", "4e-3"]),
    "192px-60": ("defects", RUNS_192_60),
    "256px": ("defects", ["--image-size", "256"]),
    "300px": ("defects", ["--image-size", "300"]),
    "soft-192px-60": (_named(Soft), RUNS_192_60),
    "mixup": (_named(Mixup), []),
    "mixup-0.4": (_named(Mixup04), []),
    "mixup-192px-60": (_named(Mixup), RUNS_192_60),
    "avg-pool": (_named(AvgPool), []),
    "one-view": (_named(OneView), []),
    "192px-60-gem": ("defects", RUNS_192_60),
    "multiscale": ("defects", ["--model", "multiscale"]),
    "multiscale-40": ("defects", ["--model", "multiscale", "--epochs", "40"]),
    "ensemble": ("defects", ["--model", "ensemble"]),
}
FIRST = ["default", "plain-conv", "20-epochs", "soft", "jitter"]

# The CLI as it is, with this directory on the path: the registry imports a variant's class from here.
CHILD = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from gpuwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, seed: int, out: Path) -> dict:
    workload, flags = VARIANTS[name]
    argv = ["train", workload, *flags, "--seed", str(seed), "--run-dir", str(out / name), "--json"]
    s = train_child(CHILD, argv, out, name)
    e = s["eval"]
    return {
        "accuracy": e["accuracy"],
        "recall": e["recall"],
        "precision": e["precision"],
        "threshold": e["threshold"],
        "accuracy@0.5": e["accuracy@0.5"],
        "recall@0.5": e["recall@0.5"],
        "roc_auc": e["roc_auc"],
        # multiscale: its members' runs (RUN/parts) and the assembly's own
        "wall_s": s["wall_s"] + sum(p["wall_s"] for p in s["data"].get("parts", {}).values()),
        "epochs": s["epochs"],
    }


if __name__ == "__main__":
    cols = ("accuracy", "recall", "precision", "threshold", "accuracy@0.5", "recall@0.5", "roc_auc")
    main(__doc__, VARIANTS, FIRST, "ELPV defects", run, cols, 14)
