"""Small data sets the training tests make on the fly: the same formats a user brings."""

import json
from pathlib import Path

import numpy as np


def image_folder(root: Path, per_class: int = 24, size: int = 64) -> Path:
    """functional/ and defective/ folders of grey PNGs; defective cells carry dark crack lines."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("functional", "defective"):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            im = (140 + 20 * rng.standard_normal((size, size))).clip(0, 255)
            if name == "defective":
                r = rng.integers(4, size - 4)
                im[r - 1 : r + 2, :] = 30
            Image.fromarray(im.astype(np.uint8)).save(root / name / f"{i:03d}.png")
    return root


def interactions_csv(path: Path, users: int = 40, items: int = 60, per_user: int = 15) -> Path:
    rng = np.random.default_rng(0)
    rows = ["user,item,timestamp,rating"]
    for u in range(users):
        liked = rng.choice(items, per_user, replace=False, p=np.linspace(2, 1, items) / np.linspace(2, 1, items).sum())
        for t, i in enumerate(liked):
            rows.append(f"u{u},i{i},{1000 + 10 * t + u},{rng.integers(1, 6)}")
    path.write_text("\n".join(rows) + "\n")
    return path


def reviews_jsonl(path: Path, n: int = 120) -> Path:
    rng = np.random.default_rng(0)
    words = [
        "this",
        "coffee",
        "tea",
        "dog",
        "food",
        "is",
        "great",
        "good",
        "bad",
        "tasty",
        "fresh",
        "my",
        "i",
        "love",
        "it",
        "and",
        "the",
        "was",
        "not",
    ]
    lines = [json.dumps({"text": " ".join(rng.choice(words, 30))}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path
