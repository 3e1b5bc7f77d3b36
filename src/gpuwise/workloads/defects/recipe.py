"""How a defects run trains: the frozen `DefectsRecipe` (its defaults are the best of docs/quality.md,
defects) and the augmentation it draws per sample."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

MODELS = ("cnn", "multiscale", "ensemble")  # --model: one CNN at --image-size, or several (`DefectsRecipe.members`)
Members = tuple[tuple[float, int], ...]  # per CNN: (its image size as a multiple of --image-size, its seed's offset)


@dataclass(frozen=True)
class DefectsRecipe:
    """Everything a defects run is trained by besides its flags. The defaults are the best of docs/quality.md,
    defects; `benchmarks/defects_ablation.py` trains others (a `Defects` subclass with another recipe). A run's
    labels.json records what loading it needs (convolutions, pooling, views, member sizes): a run loads by its
    record, never by the recipe of the day."""

    weight_standardization: bool = True  # the CNN's convolutions: `WSConv2d`, else plain ones
    pool: str = "gem"  # how the CNN pools its last map: "gem" (`GeM`) or "avg"
    views: int = 8  # test-time views averaged (`SymmetricViews`): 8, or 1 for the bare model
    # Training defaults that --epochs, --batch-size and --lr override; 40 epochs are as good as 50, for less
    epochs: int = 40
    batch_size: int = 32
    lr: float = 2e-3
    # The CNNs of --model multiscale and ensemble, each trained apart as a run of its own (`parts`), then averaged
    members: tuple[tuple[str, Members], ...] = (
        ("multiscale", ((1.0, 0), (1.5, 0))),
        ("ensemble", ((1.5, 0), (1.5, 1), (1.5, 2))),
    )
    # Members of `large_size` px or more train `large_epochs` unless --epochs says; smaller ones `epochs`
    large_size: int = 192
    large_epochs: int = 60
    # Left off, each cost accuracy or ROC-AUC: ELPV's own defect probabilities (0, 1/3, 2/3, 1) as targets;
    # brightness and contrast jitter of +-jitter; a random square crop of side (1 - crop .. 1) x the image,
    # resized back; mixup (Zhang et al. 2018), each image blended with another, weight ~ Beta(mixup, mixup).
    soft_targets: bool = False
    jitter: float = 0.0
    crop: float = 0.0
    mixup: float = 0.0

    def __post_init__(self) -> None:
        if self.pool not in ("gem", "avg") or self.views not in (1, 8):
            raise ValueError(f"pool {self.pool!r} and views {self.views!r}: pool is 'gem' or 'avg', views 8 or 1")

    def assembles(self, model: str | None) -> bool:
        """Whether --model `model` is several CNNs, trained apart and assembled."""
        return model in dict(self.members)

    def cnns(self, cfg) -> list[tuple[int, int]]:
        """(image size, seed) of each CNN of the run."""
        spec = dict(self.members).get(cfg.model or MODELS[0], ((1.0, 0),))
        return [(int(round(cfg.image_size * scale)), cfg.seed + offset) for scale, offset in spec]

    def sizes(self, cfg) -> tuple[int, ...]:
        """The image size each CNN of the run reads; the largest is the size images are loaded at."""
        return tuple(size for size, _ in self.cnns(cfg))

    def parts(self, cfg) -> list[tuple[str, object]]:
        """The members of multiscale and ensemble, each a `--model cnn` run of its own size and seed."""
        if len(found := self.cnns(cfg)) == 1:
            return []
        return [
            (
                part_name(size, seed),
                replace(cfg, model="cnn", image_size=size, seed=seed, epochs=cfg.epochs or self.part_epochs(size)),
            )
            for size, seed in found
        ]

    def part_epochs(self, size: int) -> int | None:
        """A member's epochs unless --epochs says; None: the CNN's own default (`epochs`)."""
        return self.large_epochs if size >= self.large_size else None

    def defaults(self, assembled: bool) -> dict:
        """The run's defaults; an assembled run's epochs are its parts' (`part_epochs`)."""
        return {"batch_size": self.batch_size, "lr": self.lr} | ({} if assembled else {"epochs": self.epochs})


def part_name(size: int, seed: int) -> str:
    return f"cnn-{size}px-seed{seed}"


def _crop(im: np.ndarray, r: np.random.Generator, crop: float) -> np.ndarray:
    from PIL import Image

    size = im.shape[0]
    side = int(round(size * r.uniform(1 - crop, 1)))
    y, x = (int(v) for v in r.integers(0, size - side + 1, size=2))
    patch = np.ascontiguousarray(im[y : y + side, x : x + side])
    return np.asarray(Image.fromarray(patch).resize((size, size), Image.Resampling.BILINEAR))


def augment(images: np.ndarray, indices, seed: int, epoch: int, recipe: DefectsRecipe) -> np.ndarray:
    """Flips and 90-degree turns (and the recipe's jitter and crop, where on), drawn per sample from
    (seed, epoch, index): any resume, micro-batch split or process count sees the same augmentation."""
    out = []
    for im, i in zip(images, indices, strict=True):
        r = np.random.default_rng([seed, epoch, int(i)])
        k, flip = int(r.integers(4)), bool(r.integers(2))
        im = np.rot90(im, k)
        im = np.fliplr(im) if flip else im
        if recipe.jitter:
            j = recipe.jitter
            c, b = r.uniform(1 - j, 1 + j), r.uniform(-j, j) * 128
            im = np.clip((im.astype(np.float32) - 128) * c + 128 + b, 0, 255).astype(np.uint8)
        if recipe.crop:
            im = _crop(im, r, recipe.crop)
        out.append(im)
    return np.ascontiguousarray(np.stack(out))


def mixup_partners(indices, seed: int, epoch: int, n: int, recipe: DefectsRecipe) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's partner among the n training images and its own weight (~ Beta(recipe.mixup, recipe.mixup)),
    drawn from (seed, epoch, index) like the augmentation: the same whatever batch, micro-batch or process the
    sample lands in."""
    draws = [np.random.default_rng([seed, epoch, int(i), 1]) for i in indices]
    partners = np.array([r.integers(n) for r in draws], dtype=np.int64)
    weights = np.array([r.beta(recipe.mixup, recipe.mixup) for r in draws], dtype=np.float32)
    return partners, np.maximum(weights, 1 - weights)  # the sample itself keeps the larger share
