"""The training config: one field per `gpuwise train` flag, saved whole to RUN_DIR/config.yaml."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest

WORKLOADS = ("defects", "recommender", "product-lm")
ACCELERATORS = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("auto", "ddp", "fsdp")
METHODS = ("full", "lora", "qlora")


@dataclass
class TrainConfig:
    workload: str
    data: str | None = None  # the user's own data; default: the workload's PyPI data set
    run_dir: str | None = None
    epochs: float | None = None  # default: the workload's
    max_steps: int | None = None  # overrides epochs
    batch_size: int | None = None  # the global batch: samples per optimizer step, all processes
    micro_batch_size: int | None = None  # None: auto (the largest that fits)
    lr: float | None = None
    seed: int = 0
    checkpoint_every: int | None = None  # steps; default: about 10 per run
    keep_checkpoints: int = 3
    eval_every: int | None = None  # steps; default: at the end only
    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "auto"
    precision: str = "auto"
    strategy: str = "auto"
    # defects
    image_size: int = 128
    # recommender
    init_from: str | None = None  # last week's run: warm start, embeddings grown for new ids
    # product-lm
    base: str | None = None  # a local model directory or hub id; default: a small Llama from a config
    method: str = "full"
    lora_rank: int = 16
    merge: bool = False  # lora/qlora: also save the base with the adapter merged in, as model/
    block_size: int = 128  # tokens per training sequence

    def validate(self) -> None:
        if self.workload not in WORKLOADS:
            raise GpuwiseError(f"unknown workload '{self.workload}'{closest(self.workload, WORKLOADS)}")
        for name, allowed in (
            ("accelerator", ACCELERATORS),
            ("precision", PRECISIONS),
            ("strategy", STRATEGIES),
            ("method", METHODS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise GpuwiseError(f"--{name} must be one of {', '.join(allowed)}, not '{value}'")
        for name in (
            "epochs",
            "max_steps",
            "batch_size",
            "micro_batch_size",
            "lr",
            "checkpoint_every",
            "eval_every",
            "image_size",
            "lora_rank",
            "block_size",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise GpuwiseError(f"--{name.replace('_', '-')} must be positive, not {value}")
        if self.devices < 1 or self.num_nodes < 1 or self.keep_checkpoints < 1:
            raise GpuwiseError("--devices, --num-nodes and --keep-checkpoints must be at least 1")
        if self.method != "full" and self.workload != "product-lm":
            raise GpuwiseError("--method lora/qlora applies to product-lm only")
        if self.merge and self.method == "full":
            raise GpuwiseError("--merge folds a LoRA/QLoRA adapter into its base: it needs --method lora or qlora")
        if self.strategy == "fsdp" and self.method == "qlora":
            raise GpuwiseError("--strategy fsdp cannot shard qlora's 4-bit base weights; use ddp, or --method lora")
        if self.init_from and self.workload != "recommender":
            raise GpuwiseError("--init-from (warm start from last week's run) applies to recommender only")
        if self.data and not Path(self.data).exists():
            raise GpuwiseError(f"--data {self.data}: no such file or directory")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise GpuwiseError(f"config.yaml has unknown keys: {', '.join(sorted(unknown))}")
        return cls(**data)
