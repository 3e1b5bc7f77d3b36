"""What each lever buys the defects workload on ELPV: one full training run per variant, in fresh processes
one after another, each scored on the same test cells.

Run: .venv/bin/python benchmarks/defects_ablation.py [--variants default,plain-conv,...|all] [--seed 0]

Variants (each the default run, `gpuwise train defects`, with one change); without --variants, the first five:
  default      weight-standardized convolutions, hard labels, flips and 90-degree turns, threshold from the
               validation cells
  plain-conv   plain convolutions (defects.WEIGHT_STANDARDIZATION = False, the default until 2026-12-02)
  20-epochs    --epochs 20
  soft         ELPV's own defect probabilities (0, 1/3, 2/3, 1) as targets instead of 0/1 (defects.SOFT_TARGETS)
  jitter       brightness and contrast jitter of +-20 % on top of the flips and turns (defects.JITTER = 0.2)
  crop         a random square crop of 80-100 % of the side, resized back, after the flips (defects.CROP = 0.2)
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
               turned), the targets alike, weight ~ Beta(0.2, 0.2), the image's own share the larger
               (defects.MIXUP = 0.2)
  mixup-0.4    mixup with Beta(0.4, 0.4)
  mixup-192px-60  mixup 0.2, --image-size 192 --epochs 60
  avg-pool     the last map averaged instead of GeM-pooled (defects.POOL = "avg", the default until 2026-12-02)
  one-view     the test and validation cells scored on the image alone, not averaged over its 8 flips and
               turns (defects.VIEWS = 1, the default until 2026-12-02)
  192px-60-gem  --image-size 192 --epochs 60, with the default GeM pooling and 8 views (~10 minutes)
  multiscale   --model multiscale: two CNNs trained apart, at 128 px for 40 epochs and at 192 px for 60, each a
               run of its own; the mean of their probabilities (~12 minutes; before 2026-12-02 trained
               together for 60 epochs)
  multiscale-40  the same, both for 40 epochs (~10 minutes)
  ensemble     --model ensemble: three CNNs at 192 px, 60 epochs, seeds N to N+2, trained apart; the mean of
               their probabilities (26 minutes)

Per variant: accuracy, recall and precision of "defective" at the threshold chosen on the validation cells,
accuracy and recall at 0.5 (the published figure's rule), ROC-AUC, and the run's wall time. One run per
variant takes 2-6 minutes on 2 cores; a difference of a point or so between two variants is within what
another seed moves (not measured here for every variant: run it with --seed 1 and 2 to see).
"""

from __future__ import annotations

from pathlib import Path

from ablation import main, train_child

# name: (module switches of gpuwise.workloads.defects, train flags); "model": DefectCNN keywords,
# "per_image": the child standardizes each image (a change only this benchmark makes).
VARIANTS: dict[str, tuple[dict, list[str]]] = {
    "default": ({}, []),
    "plain-conv": ({"WEIGHT_STANDARDIZATION": False}, []),
    "20-epochs": ({}, ["--epochs", "20"]),
    "soft": ({"SOFT_TARGETS": True}, []),
    "jitter": ({"JITTER": 0.2}, []),
    "crop": ({"CROP": 0.2}, []),
    "wide": ({"model": {"channels": [48, 96, 192, 384]}}, []),
    "double": ({"model": {"double": True}}, []),
    "per-image": ({"per_image": True}, []),
    "lr-1e-3": ({}, ["--lr", "1e-3"]),
    "lr-4e-3": ({}, ["--lr", "4e-3"]),
    "192px-60": ({}, ["--image-size", "192", "--epochs", "60"]),
    "256px": ({}, ["--image-size", "256"]),
    "300px": ({}, ["--image-size", "300"]),
    "soft-192px-60": ({"SOFT_TARGETS": True}, ["--image-size", "192", "--epochs", "60"]),
    "mixup": ({"MIXUP": 0.2}, []),
    "mixup-0.4": ({"MIXUP": 0.4}, []),
    "mixup-192px-60": ({"MIXUP": 0.2}, ["--image-size", "192", "--epochs", "60"]),
    "avg-pool": ({"POOL": "avg"}, []),
    "one-view": ({"VIEWS": 1}, []),
    "192px-60-gem": ({}, ["--image-size", "192", "--epochs", "60"]),
    "multiscale": ({}, ["--model", "multiscale"]),
    "multiscale-40": ({}, ["--model", "multiscale", "--epochs", "40"]),
    "ensemble": ({}, ["--model", "ensemble"]),
}
FIRST = ["default", "plain-conv", "20-epochs", "soft", "jitter"]

CHILD = """
import sys
import gpuwise.workloads.defects as d
switches = {switches!r}
model_kw = switches.pop("model", {{}})
if switches.pop("per_image", False):
    plain = d.to_tensor

    def to_tensor(images):
        x = plain(images)
        mean, std = x.mean(dim=(1, 2, 3), keepdim=True), x.std(dim=(1, 2, 3), keepdim=True)
        return (x - mean) / (std + 1e-3)

    d.to_tensor = to_tensor
if model_kw:
    base = d.DefectCNN

    class Changed(base):
        def __init__(self, *args, **kw):
            super().__init__(*args, **(kw | model_kw))

    d.DefectCNN = Changed
for name, value in switches.items():
    setattr(d, name, value)
from gpuwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, seed: int, out: Path) -> dict:
    switches, flags = VARIANTS[name]
    argv = ["train", "defects", *flags, "--seed", str(seed), "--run-dir", str(out / name), "--json"]
    s = train_child(CHILD.format(switches=switches), argv, out, name)
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
