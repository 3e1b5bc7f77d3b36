"""The training config: one field per `gpuwise train` flag, saved whole to RUN_DIR/config.yaml."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest

WORKLOADS = ("defects", "recommender", "product-lm")
ACCELERATORS = ("auto", "cpu", "cuda", "mps")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("auto", "ddp", "fsdp")
METHODS = ("full", "lora", "qlora")


# Upper bounds where a larger value would not fail cleanly but exhaust memory (a context of 10**9 tokens
# allocates its rotary tables) or could never be meant; each with its reason, printed when it is hit.
BOUNDS = (
    ("image_size", 2048, "2048 px already holds 4 M pixels per image in host memory"),
    ("block_size", 32768, "the longest context of the supported model families"),
    ("lora_rank", 4096, "a rank past the model's width adds nothing"),
    ("devices", 1024, "processes per node"),
    ("num_nodes", 100_000, "nodes"),
)
MIN_IMAGE = 32  # the default CNN: a stride-2 stem and four 2x max-pools


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

    def validate(self, check_paths: bool = True) -> None:
        """Every value in range, or one line naming the flag. `check_paths=False` for a finished run's
        saved config, whose --data may since have moved (serving does not read it)."""
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
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise GpuwiseError(f"--{name.replace('_', '-')} must be a positive finite number, not {value}")
        for name, top, why in BOUNDS:
            value = getattr(self, name)
            if value is not None and value > top:
                raise GpuwiseError(f"--{name.replace('_', '-')} {value} is over the limit of {top:,} ({why})")
        if self.image_size < MIN_IMAGE:
            raise GpuwiseError(
                f"--image-size {self.image_size} is below {MIN_IMAGE}: the defects CNN halves an image 5 times"
            )
        if not 0 <= self.seed < 2**32:
            raise GpuwiseError(f"--seed must be between 0 and 2**32 - 1 (what numpy accepts), not {self.seed}")
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
        if check_paths and self.data and not Path(self.data).exists():
            raise GpuwiseError(f"--data {self.data}: no such file or directory")
        if check_paths and self.data and not (Path(self.data).is_file() or Path(self.data).is_dir()):
            raise GpuwiseError(f"--data {self.data}: not a regular file or directory (a device or a pipe never ends)")

    def check_types(self, where: str) -> None:
        """Each field holds the type its annotation names (a hand-edited or planted config.yaml may not)."""
        for f in fields(self):
            value, allowed = getattr(self, f.name), f.type.split(" | ")
            ok = (
                (value is None and "None" in allowed)
                or (isinstance(value, bool) and "bool" in allowed)
                or (isinstance(value, int) and not isinstance(value, bool) and ("int" in allowed or "float" in allowed))
                or (isinstance(value, float) and "float" in allowed)
                or (isinstance(value, str) and "str" in allowed)
            )
            if not ok:
                raise GpuwiseError(f"{where}: {f.name} must be {' or '.join(allowed)}, not {value!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "config.yaml") -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise GpuwiseError(f"{where} has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        if "workload" not in data:
            raise GpuwiseError(f"{where} names no workload")
        cfg = cls(**data)
        cfg.check_types(where)
        cfg.validate(check_paths=False)
        return cfg
