"""defects: camera quality control on ELPV solar-cell electroluminescence images.

A cell is "defective" when ELPV's defect probability >= 0.5; a fixed, stratified 75/25 split, and 10 % of
the training cells held back to choose the model's decision threshold (recall of "defective" >= 0.80 on
them: a missed defect costs a quality line more than a second look). The test cells are scored once, at
the end, at that threshold. The default model is a plain CNN with GroupNorm and weight-standardized
convolutions (neither's math depends on how a batch is split into micro-batches, so gradient accumulation,
OOM back-off and DDP give the same weights). ``--base`` fine-tunes a local or hub image model through
transformers' from_pretrained instead.

The workload, `Defects`, is here; `data` (ELPV, folders, the split, the threshold), `model` (the networks,
a run loaded for inference), `recipe` (`DefectsRecipe`, the augmentation), `training` (`DefectsRun`, what
the loop calls) and `serving` (predict, /v1/predict) hold the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.base import BenchStep, OnnxSignature, Training, Workload, place
from gpuwise.workloads.defects.data import (
    IMAGE_SUFFIXES,
    SPLIT_SEED,
    choose_threshold,
    load_cells,
    read_image,
    recall_bound,
    sample_inputs,
    stratified_split,
    to_tensor,
)
from gpuwise.workloads.defects.model import (
    MIN_IMAGE,
    DefectCNN,
    GeM,
    MultiScale,
    PretrainedClassifier,
    SymmetricViews,
    WSConv2d,
    build_model,
    fold_standardization,
    for_inference,
    load_trained,
    save_weights,
    to_logit,
)
from gpuwise.workloads.defects.recipe import MODELS, DefectsRecipe, augment, mixup_partners
from gpuwise.workloads.defects.serving import Prediction, PredictResponse, Served, predict
from gpuwise.workloads.defects.training import DefectsRun
from gpuwise.workloads.serving import Limits

__all__ = [
    "IMAGE_SUFFIXES",
    "MIN_IMAGE",
    "MODELS",
    "SPLIT_SEED",
    "DefectCNN",
    "Defects",
    "DefectsRecipe",
    "DefectsRun",
    "GeM",
    "MultiScale",
    "Prediction",
    "PredictResponse",
    "PretrainedClassifier",
    "Served",
    "SymmetricViews",
    "WSConv2d",
    "augment",
    "build_model",
    "choose_threshold",
    "fold_standardization",
    "for_inference",
    "load_cells",
    "load_trained",
    "mixup_partners",
    "predict",
    "read_image",
    "recall_bound",
    "sample_inputs",
    "save_weights",
    "stratified_split",
    "to_logit",
    "to_tensor",
]


class Defects(Workload):
    """The defects workload, trained by its `recipe` (a subclass with another recipe trains another)."""

    name = "defects"
    summary = "camera quality control: ELPV solar-cell images, defective or not"
    options = ("image_size", "base", "model")
    inputs = "image files"
    onnx = OnnxSignature("images", "logits", ("labels.json", "model.safetensors"))
    convolutional = True
    recipe: ClassVar[DefectsRecipe] = DefectsRecipe()

    def validate(self, cfg) -> None:
        if cfg.model is not None and cfg.model not in MODELS:
            raise GpuwiseError(f"--model must be one of {', '.join(MODELS)}, not '{cfg.model}'")
        if self.recipe.assembles(cfg.model) and cfg.base:
            raise GpuwiseError(f"--model {cfg.model} trains its own CNNs; it cannot fine-tune --base")
        if cfg.image_size < MIN_IMAGE and not cfg.base:
            raise GpuwiseError(f"--image-size {cfg.image_size} is below {MIN_IMAGE}: the CNN halves an image 5 times")

    def parts(self, cfg) -> list[tuple[str, object]]:
        return self.recipe.parts(cfg)

    def new_model(self, cfg) -> nn.Module:
        """The model a run of one network trains, fresh: `--base`'s, else the recipe's CNN."""
        r = self.recipe
        return build_model(cfg, r.weight_standardization, r.pool, r.sizes(cfg))

    def build(self, cfg, run_dir: Path) -> Training:
        return DefectsRun(cfg, run_dir, self.recipe, self.new_model).training()

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        batch = batch or 32
        model = place(DefectCNN(standardized=self.recipe.weight_standardization, pool=self.recipe.pool), device)
        x, y = torch.randn(batch, 1, 128, 128, device=device), torch.rand(batch, device=device)
        return BenchStep(
            model, lambda: nn.functional.binary_cross_entropy_with_logits(model(x).float(), y), batch, None
        )

    def predict(self, run_dir: Path, cfg, inputs: list[str], **_) -> list[dict]:
        return predict(run_dir, cfg, inputs)

    def describe(self, r: dict) -> str:
        return f"{r['input']}: {r['label']} (p({r['positive_class']}) = {r['probability']:.3f})"

    def serve(self, run_dir: Path, cfg, runtime: str, limits: Limits) -> Served:
        return Served(run_dir, cfg, runtime, limits)

    def export_model(self, run_dir: Path, cfg):
        model, meta = load_trained(run_dir, cfg)
        size = meta["image_size"]
        return model, torch.zeros(2, 1, size, size), meta

    def export_inputs(self, cfg, meta: dict, n: int) -> tuple[np.ndarray, str]:
        return sample_inputs(cfg, meta, n)
