"""A fourth workload in one file: the README's "Add a workload" example, and the test of the contract.

The task: is a point of 8 numbers above a fixed plane? Synthetic data, seeded; a linear probe learns it
in a few steps. Everything gpuwise does with a workload (train, resume, predict, bench, plan --traced,
serve, export) goes through the class below and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.workloads import BenchStep, OnnxSignature, Training, Workload, place
from gpuwise.workloads.serving import ClientError, ServeContext, run_forward

FEATURES = 8


def points(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).normal(size=(n, FEATURES)).astype(np.float32)
    return x, (x @ np.linspace(-1, 1, FEATURES) > 0.1).astype(np.float32)


def probe() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1), nn.Flatten(0))


def load(run_dir: Path) -> nn.Module:
    from safetensors.torch import load_model

    model = probe()
    load_model(model, str(run_dir / "model.safetensors"))
    return model.eval()


class ScoreRequest(BaseModel):
    points: list[list[float]] = Field(min_length=1, max_length=64, description=f"Points of {FEATURES} numbers")


class ScoreResponse(BaseModel):
    above: list[bool]
    probability: list[float]


class Served:
    workload, batched = "tiny", True

    def __init__(self, run_dir: Path, runtime: str):
        self.model_name = "linear probe"
        self.forward, self.device = run_forward(run_dir, runtime, load(run_dir), torch.float32)

    def __call__(self, items: list[list[float]]) -> list[float]:
        logits = self.forward(np.asarray(items, dtype=np.float32))
        return (1 / (1 + np.exp(-logits))).tolist()

    def routes(self, ctx: ServeContext) -> None:
        @ctx.app.post("/v1/score", response_model=ScoreResponse)
        async def score(ask: ScoreRequest) -> ScoreResponse:
            if any(len(p) != FEATURES for p in ask.points):
                raise ClientError(422, f"points: each needs {FEATURES} numbers")
            probs = await ctx.answer(ask.points)  # one forward with the points of concurrent requests
            return ScoreResponse(above=[p >= 0.5 for p in probs], probability=probs)


class Tiny(Workload):
    name = "tiny"
    summary = "is a point above a plane? (synthetic; the contract's example)"
    inputs = f"points, {FEATURES} comma-separated numbers each"
    onnx = OnnxSignature("points", "logits", ("model.safetensors",))

    def build(self, cfg, run_dir: Path) -> Training:
        x_train, y_train = points(512, seed=1)
        x_test, y_test = points(256, seed=2)

        def make_batch(indices, epoch):
            return {"x": torch.from_numpy(x_train[list(indices)]), "y": torch.from_numpy(y_train[list(indices)])}

        def loss(model, batch):
            return nn.functional.binary_cross_entropy_with_logits(model(batch["x"]), batch["y"])

        @torch.no_grad()
        def evaluate(model, device):
            logits = model(torch.from_numpy(x_test).to(device)).cpu().numpy()
            return {"accuracy": float(((logits > 0) == (y_test > 0.5)).mean())}

        def save(model, run_dir: Path) -> list[str]:
            from safetensors.torch import save_model

            save_model(model, str(run_dir / "model.safetensors"))
            return ["model.safetensors"]

        majority = float(max(y_test.mean(), 1 - y_test.mean()))
        return Training(
            "tiny",
            probe(),
            len(x_train),
            make_batch,
            loss,
            evaluate,
            save,
            defaults={"epochs": 2, "batch_size": 32, "lr": 0.05},
            baseline={"name": "majority class", "accuracy": majority},
            info={"data": "synthetic points", "train": len(x_train), "test": len(x_test)},
        )

    def bench_step(self, device, batch: int | None = None) -> BenchStep:
        batch = batch or 256
        model = place(probe(), device)
        x, y = torch.randn(batch, FEATURES, device=device), torch.rand(batch, device=device)
        return BenchStep(model, lambda: nn.functional.binary_cross_entropy_with_logits(model(x), y), batch, None)

    def predict(self, run_dir: Path, cfg, inputs: list[str], **_) -> list[dict]:
        try:
            x = np.array([[float(v) for v in p.split(",")] for p in inputs], dtype=np.float32).reshape(-1, FEATURES)
        except ValueError:
            raise GpuwiseError(f"inputs: give points of {FEATURES} comma-separated numbers each") from None
        with torch.no_grad():
            probs = torch.sigmoid(load(run_dir)(torch.from_numpy(x))).tolist()
        return [{"input": p, "probability": q, "above": q >= 0.5} for p, q in zip(inputs, probs, strict=True)]

    def describe(self, r: dict) -> str:
        return f"{r['input']}: {'above' if r['above'] else 'below'} (p = {r['probability']:.3f})"

    def serve(self, run_dir: Path, cfg, runtime: str, limits) -> Served:
        return Served(run_dir, runtime)

    def export_model(self, run_dir: Path, cfg):
        return load(run_dir), torch.zeros(2, FEATURES), {}

    def export_inputs(self, cfg, meta: dict, n: int) -> tuple[np.ndarray, str]:
        return points(n, seed=2)[0], "synthetic test points"
