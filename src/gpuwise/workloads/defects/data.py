"""The defects data: ELPV or a folder per class of images, the fixed stratified split, and the decision
threshold chosen on the validation cells held back from training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuwise.errors import GpuwiseError

SPLIT_SEED = 2019  # fixed: every run, whatever its --seed, is scored on the same held-out cells
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
POSITIVE_NAMES = ("defective", "defect", "bad", "ng", "fail", "reject")
VALIDATION_SHARE = 0.10  # of the training cells: ~200 of ELPV's, ~60 of them defective
TARGET_RECALL = 0.80  # issue #13: quality control's floor for the share of defects caught
# ~60 validation defects pin recall down only to +-0.05: the threshold must reach the floor at this confidence
# to keep it on cells it has not seen (docs/quality.md, defects)
CONFIDENCE = 0.90


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    if images.shape[1:] == (size, size):
        return images
    return np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.BILINEAR)) for im in images])


def load_elpv(size: int):
    from elpv_dataset.utils import load_dataset

    images, probs, types = load_dataset()
    labels = (np.asarray(probs) >= 0.5).astype(np.int64)
    info = {
        "data": "ELPV (elpv-dataset, Deitsch et al. 2019)",
        "classes": ["functional", "defective"],
        "strata": np.char.add(np.asarray(types).astype(str), labels.astype(str)),
        "targets": np.asarray(probs, dtype=np.float32),
    }
    return _resize(images, size), labels, info


def to_grey(im, size: int) -> np.ndarray:
    """A PIL image as the model sees it: grey, size x size, uint8."""
    from PIL import Image

    return np.asarray(im.convert("L").resize((size, size), Image.Resampling.BILINEAR))


def read_image(path: Path, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            return to_grey(im, size)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise GpuwiseError(f"{path}: not a readable image ({type(e).__name__}: {e})") from None


def load_folder(root: Path, size: int):
    """The usual class-folder layout: ROOT/<class>/<image>. Two classes; the positive one is named
    like 'defective' or is the second in sorted order."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(classes) != 2:
        raise GpuwiseError(f"{root}: expected two class folders (e.g. functional/ and defective/), found {classes}")
    positive = next((c for c in classes if c.lower() in POSITIVE_NAMES), classes[1])
    ordered = [c for c in classes if c != positive] + [positive]
    images, label_list = [], []
    for label, name in enumerate(ordered):
        files = sorted(p for p in (root / name).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise GpuwiseError(f"{root / name}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        images += [read_image(f, size) for f in files]
        label_list += [label] * len(files)
    labels = np.asarray(label_list, dtype=np.int64)
    return np.stack(images), labels, {"data": str(root), "classes": ordered, "strata": labels.astype(str)}


def stratified_split(
    strata: np.ndarray, test_share: float = 0.25, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for value in np.unique(strata):
        idx = rng.permutation(np.flatnonzero(strata == value))
        cut = int(round(len(idx) * test_share))
        test += idx[:cut].tolist()
        train += idx[cut:].tolist()
    return np.sort(train), np.sort(test)


@dataclass(frozen=True)
class Cells:
    """A run's images (grey, uint8) and labels, split three ways: the training cells, the validation cells
    held back from them to choose the threshold on, and the test cells, scored once at the end."""

    x_train: np.ndarray
    y_train: np.ndarray
    t_train: np.ndarray  # the training targets: the labels as floats, or ELPV's own defect probabilities
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    info: dict  # where the data came from and its classes
    counts: dict  # the cells of each split, and the share of defective ones among all


def load_cells(data: str | None, size: int, soft_targets: bool = False) -> Cells:
    """The run's cells at `size` px: its --data folder, else ELPV. `soft_targets`: train on ELPV's own
    defect probabilities (0, 1/3, 2/3, 1) where the data has them."""
    images, labels, info = load_folder(Path(data), size) if data else load_elpv(size)
    strata = info.pop("strata")
    train_idx, test_idx = stratified_split(strata)
    fit, held = stratified_split(strata[train_idx], VALIDATION_SHARE, seed=SPLIT_SEED + 1)
    train_idx, val_idx = train_idx[fit], train_idx[held]
    soft = info.pop("targets", None)
    targets = soft if soft_targets and soft is not None else labels.astype(np.float32)
    return Cells(
        images[train_idx],
        labels[train_idx],
        targets[train_idx],
        images[val_idx],
        labels[val_idx],
        images[test_idx],
        labels[test_idx],
        info,
        {
            "train": len(train_idx),
            "validation": len(val_idx),
            "test": len(test_idx),
            "positive_share": float(labels.mean()),
        },
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 grey images -> float in [-1, 1], NCHW."""
    return (torch.from_numpy(images).float().div_(127.5).sub_(1.0)).unsqueeze(1)


def sample_inputs(cfg, meta: dict, n: int = 8) -> tuple[np.ndarray, str]:
    """Up to n real images for the exported graph, scaled as the model takes them, and where they came
    from: the run's own --data folder or ELPV; random images only when its data is not readable here."""
    size, images, source = meta["image_size"], None, None
    try:
        if cfg.data:
            root = Path(cfg.data)
            files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
            if files:  # evenly spaced over the sorted list, so both class folders are sampled
                pick = [files[int(i)] for i in np.unique(np.linspace(0, len(files) - 1, n).astype(int))]
                images, source = np.stack([read_image(f, size) for f in pick]), str(root)
        else:
            from elpv_dataset.utils import load_dataset

            all_images = load_dataset()[0]
            images = _resize(all_images[np.linspace(0, len(all_images) - 1, n).astype(int)], size)
            source = "ELPV"
    except (GpuwiseError, ImportError, OSError, ValueError):
        images = None
    if images is None:
        images = np.random.default_rng(0).integers(0, 256, (n, size, size), dtype=np.uint8)
        source = "random images (the run's data is not readable here)"
    assert source is not None  # set together with images on every path
    return to_tensor(images).numpy(), source


def recall_bound(caught: int, positives: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided Clopper-Pearson lower bound of the recall `caught` / `positives` measures: the true
    recall is at least this with probability `confidence`."""
    from scipy.stats import beta

    return float(beta.ppf(1 - confidence, caught, positives - caught + 1)) if caught else 0.0


def choose_threshold(
    probs: np.ndarray, labels: np.ndarray, recall: float = TARGET_RECALL, confidence: float | None = CONFIDENCE
) -> tuple[float, str]:
    """The highest threshold whose recall of the positive class on (probs, labels) reaches `recall`, as
    precise as that recall allows; with `confidence`, whose recall's lower confidence bound reaches it, so
    that it holds on new cells too. Too few positives for the bound: the threshold that catches them all.
    0.5 when there is no positive to measure recall on."""
    positives = np.sort(probs[labels == 1])[::-1]
    n = len(positives)
    if n == 0:
        return 0.5, "0.5: no defective cell among the validation cells to choose it on"
    if confidence is None:
        need, rule = int(np.ceil(recall * n)), f"recall >= {recall:.2f}"
    else:  # the fewest caught whose bound reaches the floor (the bound grows with what is caught)
        need = next((k for k in range(1, n + 1) if recall_bound(k, n, confidence) >= recall), n)
        rule = f"recall >= {recall:.2f} at {confidence:.0%} confidence"
        if recall_bound(need, n, confidence) < recall:
            rule += f" (not reachable with {n} defective: all of them caught)"
    threshold = float(positives[need - 1])
    caught = int((positives >= threshold).sum())
    return threshold, (
        f"{threshold:.3f}: the highest with {rule} on {len(labels)} validation cells held out "
        f"of the training cells ({caught} of {n} defective)"
    )
