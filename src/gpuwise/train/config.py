"""The training config: one field per `gpuwise train` flag, frozen, saved whole to RUN_DIR/config.yaml once
the workload's defaults are filled in (`filled`), which is the only way it changes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.workloads.base import WORKLOAD_OPTIONS, Workload
from gpuwise.workloads.registry import get, names

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


@dataclass(frozen=True)
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
    # Options only some workloads read (each lists them in its `options`; workloads.base.WORKLOAD_OPTIONS)
    image_size: int = 128  # images are resized to this square
    init_from: str | None = None  # last week's run: warm start, embeddings grown for new ids
    base: str | None = None  # a local model directory or hub id; default: a small Llama from a config
    method: str | None = None  # full, lora or qlora; None: the workload's default
    lora_rank: int = 16
    merge: bool = False  # lora/qlora: also save the base with the adapter merged in, as model/
    block_size: int = 128  # tokens per training sequence
    model: str | None = None  # which of its models a workload trains, where it has several (its `validate` checks)

    def workload_def(self, untrusted_dir: Path | None = None) -> Workload:
        """The workload this config names; `untrusted_dir`: the run directory the config was read from
        (registry.get: a package.module:Class from there must also be named on the command line)."""
        return get(self.workload, untrusted_dir)

    def validate(self, check_paths: bool = True, run_dir: Path | None = None) -> None:
        """Every value in range, or one line naming the flag. `check_paths=False` for a finished run's
        saved config, whose --data may since have moved (serving does not read it); `run_dir`: where
        that config was read from."""
        workload = self.workload_def(run_dir)
        for name, allowed in (
            ("accelerator", ACCELERATORS),
            ("precision", PRECISIONS),
            ("strategy", STRATEGIES),
            ("method", METHODS),
        ):
            value = getattr(self, name)
            if value is not None and value not in allowed:
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
        if not 0 <= self.seed < 2**32:
            raise GpuwiseError(f"--seed must be between 0 and 2**32 - 1 (what numpy accepts), not {self.seed}")
        if self.devices < 1 or self.num_nodes < 1 or self.keep_checkpoints < 1:
            raise GpuwiseError("--devices, --num-nodes and --keep-checkpoints must be at least 1")
        self._check_options(workload)
        if self.merge and self.method == "full":
            raise GpuwiseError("--merge folds a LoRA/QLoRA adapter into its base: it needs --method lora or qlora")
        if self.strategy == "fsdp" and self.method == "qlora":
            raise GpuwiseError("--strategy fsdp cannot shard qlora's 4-bit base weights; use ddp, or --method lora")
        if check_paths and self.data and not Path(self.data).exists():
            raise GpuwiseError(f"--data {self.data}: no such file or directory")
        if check_paths and self.data and not (Path(self.data).is_file() or Path(self.data).is_dir()):
            raise GpuwiseError(f"--data {self.data}: not a regular file or directory (a device or a pipe never ends)")

        workload.validate(self)
        if check_paths:
            workload.check_files(self)

    def _check_options(self, workload: Workload) -> None:
        """A workload option set away from its default for a workload that does not read it is a mistake."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in WORKLOAD_OPTIONS:
            if name not in workload.options and getattr(self, name) != defaults[name]:
                flag = "--" + name.replace("_", "-")
                users = [n for n in names() if n != self.workload and name in get(n).options]
                where = f"applies to {', '.join(users)} only" if users else "applies to no workload installed"
                takes = ", ".join("--" + o.replace("_", "-") for o in workload.options) or "none"
                raise GpuwiseError(f"{flag} {where}; {self.workload} takes these options: {takes}")

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

    def resolved(self, untrusted_dir: Path | None = None) -> TrainConfig:
        """The config with its workload's `resolve` filled in: the options that follow from others (a base's
        method). The first step of the one resolution train, launch and the record all make: this, then the
        workload's defaults and the layout (`train.setup.lay_out`). A no-op on a config resolved already."""
        return self.filled(self.workload_def(untrusted_dir).resolve(self))

    def filled(self, defaults: dict) -> TrainConfig:
        """A copy with `defaults` ({field: value}: the workload's) in the fields the flags left unset; keys that
        are not fields (a workload's weight_decay) are ignored."""
        known = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in defaults.items() if k in known and getattr(self, k) is None})

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(
        cls, data: dict, where: str = "config.yaml", run_dir: Path | None = None, resolve: bool = True
    ) -> TrainConfig:
        """A config read from a file, checked as strictly as flags. `resolve=False` (a page that only shows it)
        checks the types and looks up no workload, so that nothing the name points to is imported."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise GpuwiseError(f"{where} has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        if "workload" not in data:
            raise GpuwiseError(f"{where} names no workload")
        cfg = cls(**data)
        cfg.check_types(where)
        if resolve:
            cfg.validate(check_paths=False, run_dir=run_dir)
        return cfg
