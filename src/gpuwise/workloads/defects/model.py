"""The defects models: the CNN (`DefectCNN`: `WSConv2d`, GroupNorm, `GeM`), a transformers image model
(`PretrainedClassifier`), CNNs at several sizes averaged (`MultiScale`), the test-time views
(`SymmetricViews`), and a trained run loaded for inference as it recorded itself (`load_trained`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.workloads.defects.data import to_tensor

MIN_IMAGE = 32  # the default CNN: a stride-2 stem and four 2x max-pools


class WSConv2d(nn.Conv2d):
    """A convolution whose kernel is standardized per output channel (zero mean, unit variance) before it is
    applied: Weight Standardization (Qiao et al., 2019, arXiv 1903.10520). Beside GroupNorm it trains as fast
    as BatchNorm, and, unlike BatchNorm, a sample's output depends on no other sample. Why it is the default:
    it trained the CNN to a lower loss and a higher accuracy on ELPV than plain convolutions (docs/quality.md,
    defects)."""

    def standardized(self) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        return (w - mean) * torch.rsqrt(var + 1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized(), self.bias)


def _conv(c_in: int, c_out: int, groups: int, standardized: bool = True, **kw) -> list[nn.Module]:
    conv = WSConv2d if standardized else nn.Conv2d
    return [
        conv(c_in, c_out, kw.pop("k", 3), padding=kw.pop("p", 1), bias=False, **kw),
        nn.GroupNorm(groups, c_out),
        nn.ReLU(inplace=True),
    ]


class GeM(nn.Module):
    """Generalized-mean pooling (Radenović et al. 2019, arXiv 1711.02512): per channel, (mean of x^p)^(1/p),
    with p learned from 3: between the average (p = 1) and the maximum (p -> infinity). A defect is a crack
    or a dark patch in one part of the cell, which an average over the whole map dilutes. In float32: in
    bf16 (an 8-bit mantissa) x^p and its p-th root would round twice."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6):
        super().__init__()
        # shape [1], not a scalar: FSDP's fully_shard refuses 0-d parameters
        self.p, self.eps = nn.Parameter(torch.tensor([float(p)])), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p.float()
        return x.float().clamp(min=self.eps).pow(p).mean(dim=(2, 3)).pow(1.0 / p).to(x.dtype)


class DefectCNN(nn.Module):
    """A strided 5x5 stem, then stages of a 3x3 convolution and a max-pool. GroupNorm, not BatchNorm:
    a sample's output must not depend on the other samples of its micro-batch. One convolution per stage:
    two were slower and no more accurate (docs/quality.md, defects). `standardized`: its convolutions are
    `WSConv2d` (the default), else plain ones, as in older runs. `pool`: "gem" pools the last map by `GeM`
    (the default), "avg" by its average, as older runs."""

    def __init__(
        self,
        channels=(32, 64, 128, 256),
        groups: int = 8,
        double: bool = False,
        standardized: bool = True,
        pool: str = "gem",
    ):
        super().__init__()
        ws = standardized
        layers = _conv(1, channels[0], groups, ws, k=5, p=2, stride=2)
        c_in = channels[0]
        for c in channels:
            layers += _conv(c_in, c, groups, ws) + (_conv(c, c, groups, ws) if double else []) + [nn.MaxPool2d(2)]
            c_in = c
        self.features = nn.Sequential(*layers)
        # No dropout: a forward that draws no random numbers gives the same step on 1 or N processes.
        if pool == "gem":
            self.head = nn.Sequential(GeM(), nn.Linear(c_in, 1))
        else:  # the layout of runs trained before GeM: their state dicts name the linear layer head.2
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).squeeze(1)


class PretrainedClassifier(nn.Module):
    """A transformers image model with one logit, fed grey images as its channels expect."""

    def __init__(self, base: str):
        super().__init__()
        from transformers import AutoModelForImageClassification

        try:
            self.net = AutoModelForImageClassification.from_pretrained(base, num_labels=1, ignore_mismatched_sizes=True)
        except Exception as e:  # noqa: BLE001 - a broken config.json raises anything from TypeError to KeyError
            raise GpuwiseError(f"--base {base}: cannot load an image model ({first_line(e)})") from None
        self.channels = getattr(self.net.config, "num_channels", 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=x.expand(-1, self.channels, -1, -1)).logits.squeeze(1)


def to_logit(p: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)), p kept off 0 and 1: the models' output stays a logit when it averages probabilities."""
    p = p.clamp(1e-7, 1 - 1e-7)
    return torch.log(p) - torch.log1p(-p)


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Images NCHW to size x size, bilinear and antialiased (as PIL resizes), in float32: CPU autocast would
    hand the antialiased kernel bf16, which it does not implement. (Entered only under autocast, so an
    exported graph holds no autocast region.)"""
    if x.shape[-1] == size:
        return x
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return nn.functional.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True)
    return nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True)


class MultiScale(nn.Module):
    """CNNs that each read the image at their own size (the input resized down, antialiased, inside the
    forward, so one image array feeds both); the prediction is the mean of their probabilities.
    `forward(x, members=True)`: one logit per member. `--model multiscale` trains its members apart, each
    a run of its own (`Defects.parts`), and assembles them; older runs trained them together, each on its
    own loss. Why two sizes: CNNs at two sizes, trained apart, miss fewer of the same cells than two at one
    size or two trained together (docs/quality.md, defects)."""

    def __init__(self, sizes: tuple[int, ...], **cnn: object):
        super().__init__()
        self.sizes = tuple(sizes)
        self.members = nn.ModuleList(DefectCNN(**cnn) for _ in self.sizes)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, members: bool = False) -> torch.Tensor:
        logits = [member(resize(x, size)) for member, size in zip(self.members, self.sizes, strict=True)]
        stacked = torch.stack(logits, dim=1)
        return stacked if members else to_logit(torch.sigmoid(stacked.float()).mean(dim=1))


class SymmetricViews(nn.Module):
    """Test-time augmentation: the model's probability averaged over the 8 flips and quarter turns of the
    image, the views it trained on (`augment`), as one batch 8x the size. A cell's class does not change when
    it is turned or flipped, but the CNN's output does: what one view misses another may catch
    (docs/quality.md, defects). Evaluation, prediction, serving and export run it; training does not."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turns = [torch.rot90(x, k, dims=(2, 3)) for k in range(4)]
        views = torch.cat(turns + [t.flip(3) for t in turns])
        probs = torch.sigmoid(self.model(views).float()).reshape(len(turns) * 2, x.shape[0])
        return to_logit(probs.mean(dim=0))


def build_model(cfg, standardized: bool, pool: str, sizes: tuple[int, ...]) -> nn.Module:
    """A run's model: `--base`'s image model, else a CNN (`MultiScale` for several sizes) with these
    convolutions and pooling."""
    if cfg.base:
        return PretrainedClassifier(cfg.base)
    kw = {"standardized": standardized, "pool": pool}
    return MultiScale(tuple(sizes), **kw) if len(sizes) > 1 else DefectCNN(**kw)  # type: ignore[arg-type]


@torch.no_grad()
def predict_proba(model: nn.Module, images: np.ndarray, device, batch: int = 32) -> np.ndarray:
    model.eval()
    out = []
    for start in range(0, len(images), batch):
        x = to_tensor(images[start : start + batch]).to(device)
        out.append(torch.sigmoid(model(x).float()).cpu().numpy())
    model.train()
    return np.concatenate(out) if out else np.zeros(0)


def save_weights(model: nn.Module, run_dir: Path) -> list[str]:
    from safetensors.torch import save_model

    save_model(model, str(run_dir / "model.safetensors"))
    return ["model.safetensors"]


def recorded_layout(meta: dict, where: Path) -> tuple[bool, str, int]:
    """How a run's CNN was built and is scored, from its labels.json: weight-standardized convolutions, the
    pooling, the test-time views. Runs from before these keys: plain convolutions, average pooling, one view.
    The same tensors would load into either convolution: only the run's own record says which it trained."""
    pool, views = meta.get("pool", "avg"), meta.get("views", 1)
    if pool not in ("gem", "avg") or views not in (1, 8):
        raise GpuwiseError(
            f"{where / 'labels.json'}: pool {pool!r} and views {views!r}; this version reads "
            "pool 'gem' or 'avg' and views 8 or 1"
        )
    return bool(meta.get("weight_standardization")), pool, views


def load_trained(run_dir: Path, cfg) -> tuple[nn.Module, dict]:
    """A finished run's model for inference, built as its labels.json records (never by today's recipe):
    standardization folded, channels-last, in its test-time views; and that record."""
    from safetensors.torch import load_model

    meta = json.loads((run_dir / "labels.json").read_text())
    standardized, pool, views = recorded_layout(meta, run_dir)
    model = build_model(cfg, standardized, pool, tuple(meta.get("sizes", [meta["image_size"]])))
    load_model(model, str(run_dir / "model.safetensors"))
    model = channels_last(fold_standardization(model))
    return (SymmetricViews(model) if views == 8 else model).eval(), meta


def channels_last(model: nn.Module) -> nn.Module:
    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stubs omit it


def for_inference(model: nn.Module) -> nn.Module:
    """A copy of the trained CNN to score with, as `predict` and `serve` load it: in float32 (bf16 weights
    upcast exactly), standardization folded, and its kernels in channels-last memory, in which CPU
    convolutions and max-pools run faster in float32 (docs/benchmarks.md). The trained module is left as it
    was, so training and its checkpoints keep their layout. Weights sharded across processes (FSDP) are
    scored where they are."""
    from torch.distributed.tensor import DTensor

    raw = getattr(model, "module", model)  # Fabric's wrapper keeps the module it wraps there
    if any(isinstance(p, DTensor) for p in raw.parameters()):
        return model
    return channels_last(fold_standardization(copy.deepcopy(raw))).float().eval()


@torch.no_grad()
def fold_standardization(model: nn.Module) -> nn.Module:
    """For inference: each `WSConv2d` becomes a plain convolution holding its standardized kernel (the same
    outputs, without recomputing the kernel at every call; and what ONNX export then sees is a plain Conv)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, WSConv2d):
                plain = nn.Conv2d(
                    child.in_channels,
                    child.out_channels,
                    child.kernel_size,  # type: ignore[arg-type]
                    stride=child.stride,  # type: ignore[arg-type]
                    padding=child.padding,  # type: ignore[arg-type]
                    dilation=child.dilation,  # type: ignore[arg-type]
                    groups=child.groups,
                    bias=child.bias is not None,
                    padding_mode=child.padding_mode,
                )
                plain.weight.copy_(child.standardized())
                if child.bias is not None and plain.bias is not None:
                    plain.bias.copy_(child.bias)
                setattr(parent, name, plain)
    return model
