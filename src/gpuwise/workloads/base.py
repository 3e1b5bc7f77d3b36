"""The workload contract: everything gpuwise does with a workload goes through one `Workload` object.

`train` calls `build` and gets a `Training` (data, model, loss, metrics, baselines, defaults); `bench` and
`plan --traced` call `bench_step` (a synthetic batch of the real shapes); `predict` calls `predict`;
`serve` calls `serve` and gets a `Served` model (decode -> predict a batch -> encode, as LitServe's LitAPI)
that adds its own routes; `export` uses `onnx`, `export_model` and `export_inputs` where the workload
has an ONNX graph. A new workload is one module with one subclass: see `gpuwise.workloads.registry` for
how a name reaches it (built in, a `gpuwise.workloads` entry point, or `package.module:Class`).
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from gpuwise.errors import GpuwiseError

if TYPE_CHECKING:
    import numpy as np
    import torch

    from gpuwise.workloads.serving import CausalLM, Limits, Served


@dataclass
class Training:
    """What the training loop needs of a workload, built for one run. The loop knows nothing else."""

    name: str
    model: Any  # torch.nn.Module, built on the CPU; the loop hands it to Fabric
    train_size: int
    # (sample indices, epoch) -> a batch of CPU tensors; augmentation is seeded by (seed, epoch, index)
    make_batch: Callable[[Sequence[int], int], dict]
    loss: Callable[[Any, dict], Any]  # (model, batch on device) -> mean loss over the batch
    evaluate: Callable[[Any, Any], dict]  # (model, device) -> metrics on the held-out split
    save: Callable[[Any, Path], list[str]]  # (model, run dir) -> files written
    defaults: dict  # epochs, batch_size, lr (and weight_decay where it differs from AdamW's)
    baseline: dict = field(default_factory=dict)
    tokens_per_sample: int | None = None
    model_spec: Any = None  # a plan.model.ModelSpec when the analytic planner applies
    info: dict = field(default_factory=dict)  # what the summary should say about data and model
    eval_before: bool = False  # also evaluate before the first step (the "before" of a fine-tune)
    # The steps this run trains whatever --epochs and --max-steps say; None: those decide. 0 for a model
    # assembled from its parts (`Workload.parts`): the run scores and saves what they learned.
    steps: int | None = None


class BenchStep(NamedTuple):
    """One training step on synthetic inputs of the real shapes, for `bench` and `plan --traced`."""

    model: Any  # torch.nn.Module
    loss: Callable[[], Any]  # () -> the loss of one forward on the fixed batch
    samples: int  # per step
    tokens: int | None  # per sample, for language models


@dataclass(frozen=True)
class OnnxSignature:
    input: str  # the graph's input name
    output: str  # its output name
    files: tuple[str, ...]  # the run files the torch model is rebuilt from


# The TrainConfig fields a workload may read beyond the common ones (data, epochs, batch, lr, devices...):
# each workload lists those it uses in `options`; a value given for one it does not use is refused.
WORKLOAD_OPTIONS = ("image_size", "init_from", "base", "method", "lora_rank", "merge", "block_size", "model")


class Workload(ABC):
    """A workload: subclass it, set `name`, implement the abstract methods. Instances hold no run state:
    every method is given the config (a `gpuwise.train.config.TrainConfig`) and the run directory."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for `gpuwise train --help`
    options: ClassVar[tuple[str, ...]] = ()  # which of WORKLOAD_OPTIONS it reads
    inputs: ClassVar[str] = "inputs"  # what `gpuwise predict RUN INPUT...` takes, for its help
    onnx: ClassVar[OnnxSignature | None] = None  # None: `export --format onnx` does not apply
    # A model whose GPU speed-up the published ResNet-50 throughputs describe (a CNN): bench projects its
    # step onto catalog GPUs with them.
    convolutional: ClassVar[bool] = False

    # --- train ------------------------------------------------------------------------------------
    def validate(self, cfg: Any) -> None:
        """Refuse option values this workload cannot train with, in one line naming the flag."""
        return None  # every value the common checks let through is fine

    def check_files(self, cfg: Any) -> None:
        """Refuse files the config names that this workload cannot start from (e.g. an `--init-from` run of
        another model), in one line, before anything loads. Only before training: a finished run's saved
        config may name files that have moved since."""
        return None

    def resolve(self, cfg: Any) -> dict[str, Any]:
        """Option defaults that depend on other options, known before any data loads (say, the method a
        base model is tuned with), as {field: value} for the fields left unset. Train writes them into the
        run's config once, before `build`, which reads the config and never changes it. Default: none."""
        return {}

    def parts(self, cfg: Any) -> list[tuple[str, Any]]:
        """Runs this one is assembled from, as (name, TrainConfig with run_dir unset): the loop trains each
        to its end in RUN/parts/NAME before it builds this run, which then reads them from there (e.g. the
        members of an ensemble, trained apart). Default: none."""
        return []

    @abstractmethod
    def build(self, cfg: Any, run_dir: Path) -> Training:
        """Load the data, build the model, and say how to batch, score and save it."""

    def plan_build(self, cfg: Any, run_dir: Path) -> Training:
        """The run as `build` makes it, for `gpuwise launch` to plan on the machine that submits the job: its
        data loaded and counted, its model with the shapes and dtypes it will have but, where its weights
        would be downloaded or loaded, none: built on fake tensors (torch's FakeTensorMode), on which one step
        is planned and nothing is allocated. Default: `build`, for a model built from code."""
        return self.build(cfg, run_dir)

    # --- bench, plan --traced ---------------------------------------------------------------------
    @abstractmethod
    def bench_step(self, device: torch.device, batch: int | None = None) -> BenchStep:
        """The model at its default size and one fixed synthetic batch (`batch` samples, else the default).
        Also called under fake tensors by `plan --traced`: put the model on `device` with `place`."""

    # --- predict, serve ---------------------------------------------------------------------------
    @abstractmethod
    def predict(self, run_dir: Path, cfg: Any, inputs: list[str], **options: Any) -> list[dict]:
        """A finished run's answers for the CLI's inputs (options: k, max_tokens; ignore what does not apply)."""

    def describe(self, result: dict) -> str:
        """One `predict` result as plain text for the terminal (printed as is: no markup)."""
        return json.dumps(result, ensure_ascii=False)

    def serve(self, run_dir: Path, cfg: Any, runtime: str, limits: Limits) -> Served | CausalLM:
        """A finished run loaded for serving: its model in memory and its routes; or, for a language model,
        the model and its tokenizer, which the server runs behind the OpenAI API."""
        raise GpuwiseError(f"workload {self.name} has no server")

    # --- export -----------------------------------------------------------------------------------
    def export_model(self, run_dir: Path, cfg: Any) -> tuple[torch.nn.Module, torch.Tensor, dict]:
        """(module to export in eval mode, an example input with a batch of 2, the run's meta)."""
        raise GpuwiseError(f"export --format onnx does not apply to workload {self.name}")

    def export_inputs(self, cfg: Any, meta: dict, n: int) -> tuple[np.ndarray, str]:
        """Up to n real inputs for the exported graph, and where they came from."""
        raise GpuwiseError(f"export --format onnx does not apply to workload {self.name}")


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A freshly built model on `device`. Left where it is on the CPU: `plan --traced` calls `bench_step`
    under fake tensors, where a module cannot be moved (its parameters are already fake CPU tensors)."""
    return model if device.type == "cpu" else model.to(device)


@contextlib.contextmanager
def whole_params(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Gather FSDP's shards for code that reads weights outside forward (e.g. scoring every item);
    nothing to do for a model that is not sharded. Every process must enter it together."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
    try:
        yield model
    finally:
        for m in sharded:
            m.reshard()
