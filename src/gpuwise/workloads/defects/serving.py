"""A finished defects run answering: `predict` for the CLI, and `Served` behind POST /v1/predict (images in,
a label and a probability per image out)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from fastapi import File, UploadFile  # at module level: FastAPI resolves the route's annotations here
from pydantic import BaseModel, Field

from gpuwise.workloads.defects.data import read_image, to_grey, to_tensor
from gpuwise.workloads.defects.model import SymmetricViews, load_trained, predict_proba
from gpuwise.workloads.serving import ClientError, Limits, ServeContext, run_forward


def predict(run_dir: Path, cfg, inputs: list[str], **_) -> list[dict]:
    model, meta = load_trained(run_dir, cfg)
    images = np.stack([read_image(Path(p), meta["image_size"]) for p in inputs])
    probs = predict_proba(model, images, "cpu")
    return [
        {
            "input": p,
            "probability": float(q),
            "label": meta["classes"][int(q >= meta["threshold"])],
            "positive_class": meta["classes"][1],
        }
        for p, q in zip(inputs, probs, strict=True)
    ]


class Prediction(BaseModel):
    file: str
    probability: float = Field(description="Probability of the positive class")
    label: str


class PredictResponse(BaseModel):
    predictions: list[Prediction]


class Served:
    """The trained model behind /v1/predict; the dynamic batcher calls it with the decoded images of
    concurrent requests, one forward pass for all."""

    workload, batched = "defects", True

    def __init__(self, run_dir: Path, cfg, runtime: str, limits: Limits):
        model, meta = load_trained(run_dir, cfg)
        self.size, self.classes, self.threshold = meta["image_size"], meta["classes"], meta["threshold"]
        self.limits = limits
        inner = model.model if isinstance(model, SymmetricViews) else model
        self.model_name = meta.get("base") or type(inner).__name__ + (" x 8 views" if inner is not model else "")
        self.forward, self.device = run_forward(run_dir, runtime, model, torch.float32)

    def _open(self, data: bytes, name: str):
        """The image's header only (no pixels decoded): format and size checked against the limits."""
        from PIL import Image, UnidentifiedImageError

        try:
            im = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise ClientError(422, f"{name}: not a readable PNG or JPEG image ({type(e).__name__})") from None
        if im.format not in ("PNG", "JPEG"):
            raise ClientError(415, f"{name}: {im.format} image; send PNG or JPEG")
        if im.width * im.height > self.limits.max_pixels:
            raise ClientError(
                413, f"{name}: {im.width}x{im.height} pixels is over the limit of {self.limits.max_pixels:,}"
            )
        return im

    def pixels(self, data: bytes, name: str) -> int:
        """Pixels the image will decode to, read from its header: cheap enough for the event loop."""
        with self._open(data, name) as im:
            return im.width * im.height

    def decode(self, data: bytes, name: str) -> np.ndarray:
        """PNG/JPEG bytes -> the grey, resized array the model was trained on. Seconds for a large image:
        the server calls it off the event loop."""
        from PIL import Image

        with self._open(data, name) as im:
            try:
                im.load()
                return to_grey(im, self.size)
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                raise ClientError(422, f"{name}: not a readable PNG or JPEG image ({type(e).__name__})") from None

    def __call__(self, images: list[np.ndarray]) -> list[dict]:
        logits = self.forward(to_tensor(np.stack(images)).numpy())
        probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
        return [{"probability": float(p), "label": self.classes[int(p >= self.threshold)]} for p in probs]

    def routes(self, ctx: ServeContext) -> None:
        limits = ctx.limits

        @ctx.app.post("/v1/predict", response_model=PredictResponse)
        async def predict(file: Annotated[list[UploadFile], File(description="PNG or JPEG, repeatable")]):
            if len(file) > limits.max_images:
                raise ClientError(413, f"{len(file)} images; at most {limits.max_images} per request")
            blobs = [(await f.read(), f.filename or f"file {n + 1}") for n, f in enumerate(file)]
            pixels = sum(self.pixels(data, name) for data, name in blobs)  # headers only: cheap
            if pixels > limits.max_request_pixels:
                raise ClientError(413, f"{pixels:,} pixels in this request; at most {limits.max_request_pixels:,}")
            loop = asyncio.get_running_loop()
            decoding = loop.run_in_executor(ctx.decoder, lambda: [self.decode(data, name) for data, name in blobs])
            try:
                images = await asyncio.wait_for(decoding, limits.timeout_s)
            except TimeoutError:
                raise ClientError(
                    504, f"images not decoded within the {limits.timeout_s:g} s request timeout"
                ) from None
            results = await ctx.answer(images)
            return PredictResponse(
                predictions=[Prediction(file=f.filename or "", **r) for f, r in zip(file, results, strict=True)]
            )
