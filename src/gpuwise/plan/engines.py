"""Which engine serves a language model, and what vLLM is told when it does: its engine arguments, set from
gpuwise's plan. `gpuwise serve --engine vllm` starts vLLM with them; `gpuwise plan --task inference` prints
the same command line for the accelerator it recommends."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

ENGINES = ("auto", "gpuwise", "vllm")
# vLLM's LoRA kernels are built for these ranks (vllm/config/lora.py: max_lora_rank's choices)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# vLLM's own default share of GPU memory for weights, activations and its KV cache; gpuwise's engine leaves the
# same tenth free on CUDA (serve/llm.py free_bytes)
GPU_MEMORY_UTILIZATION = 0.9


def auto_engine(device: str, vllm_found: bool) -> tuple[str, str]:
    """`--engine auto`: (engine, why). The rule, from benchmarks/llm_serve_load.py (docs/serving.md):
    - CUDA: vLLM where it is installed: CUDA graphs, paged-attention kernels, tensor and pipeline parallelism;
      gpuwise's engine decodes eagerly there.
    - CPU: gpuwise's engine: level with vLLM-CPU or ahead on tokens/s at 32 streams, its first tokens several
      times sooner at 8 and 32; vLLM-CPU led at 1 stream, and at 8 in some runs. gpuwise's engine also starts in
      seconds rather than a minute and holds about half the memory."""
    if device == "cuda":
        if vllm_found:
            return "vllm", "auto: a CUDA device and vLLM installed (CUDA graphs, paged attention)"
        return "gpuwise", "auto: a CUDA device but no vLLM found (--vllm-python, GPUWISE_VLLM_PYTHON)"
    return "gpuwise", "auto: on a CPU gpuwise's engine: level with vLLM-CPU or ahead at 32 streams, first tokens sooner"


def tensor_parallel(weight_bytes: float, gpu_bytes: float, gpus: int, kv_share: float = 0.2) -> int:
    """`gpuwise serve --engine vllm` on CUDA: the fewest of this machine's GPUs, a power of two (vLLM splits the
    attention heads evenly), over which the weights fit in `gpu_memory_utilization` of each GPU with `kv_share`
    of that left for the KV cache. More GPUs than that only add communication to each step. All the GPUs, a
    power of two, where even they are too few: vLLM then says what is short."""
    tp, room = 1, gpu_bytes * GPU_MEMORY_UTILIZATION * (1 - kv_share)
    while tp * 2 <= gpus and weight_bytes / tp > room:
        tp *= 2
    return tp


def lora_rank(rank: int) -> int:
    """The smallest rank vLLM is built for that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"a LoRA rank of {rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class VLLMArgs:
    """vLLM's OpenAI server, as gpuwise's plan sets it. `kv_cache_gib` is `VLLM_CPU_KVCACHE_SPACE` on a CPU;
    on CUDA vLLM takes `gpu_memory_utilization` of the device and gives its KV cache what the weights leave."""

    model: str
    served_name: str
    dtype: str  # gpuwise's name: fp32, bf16, fp16
    max_model_len: int
    max_num_seqs: int
    device: str = "cuda"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    kv_cache_gib: int | None = None  # CPU
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION  # CUDA
    prefix_caching: bool = True
    quantization: str | None = None  # fp8: vLLM quantizes the 16-bit weights as it loads them
    max_lora_rank: int = 0  # 0: no LoRA
    lora_modules: tuple[tuple[str, str], ...] = ()
    # CPU: no graph capture at start-up (vLLM-CPU 0.32 answered in 49 s with it, 165-215 s without:
    # docs/serving.md); on CUDA the graphs are what vLLM is chosen for
    eager: bool = False

    @property
    def ray(self) -> bool:
        """More GPUs than one node holds: vLLM spreads its workers over a Ray cluster (pipeline stages across
        nodes, tensor parallel within each)."""
        return self.tensor_parallel * self.pipeline_parallel > NODE_GPUS

    def args(self) -> list[str]:
        out = [
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--dtype", VLLM_DTYPES[self.dtype],
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            # weights from safetensors only: vLLM's "auto" falls back to pickled .bin files, which can run code
            "--load-format", "safetensors",
        ]  # fmt: skip
        if self.tensor_parallel > 1:
            out += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if self.pipeline_parallel > 1:
            out += ["--pipeline-parallel-size", str(self.pipeline_parallel)]
        if self.ray:
            out += ["--distributed-executor-backend", "ray"]
        if self.device == "cuda":
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        out += ["--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.quantization:  # the plan counts fp8 keys and values too (plan/memory.py: 1 byte a value)
            out += ["--quantization", self.quantization, "--kv-cache-dtype", self.quantization]
        if self.max_lora_rank:
            out += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            out += ["--max-loras", str(max(1, len(self.lora_modules)))]
            if self.lora_modules:
                out += ["--lora-modules", *(f"{name}={path}" for name, path in self.lora_modules)]
        if self.eager:
            out += ["--enforce-eager"]
        return out

    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)} if self.kv_cache_gib else {}

    def command(self, python: str = "python") -> str:
        """The shell line a user runs to start the same server by hand."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env().items()]
        server = [shlex.quote(python), "-m", "vllm.entrypoints.openai.api_server"]
        return " ".join([*env, *server, shlex.join(self.args())])

    def summary(self) -> str:
        """The knobs, for the plan line."""
        kv = (
            f"KV cache {self.kv_cache_gib} GiB (VLLM_CPU_KVCACHE_SPACE)"
            if self.device == "cpu"
            else f"gpu_memory_utilization {self.gpu_memory_utilization:g}"
        )
        parts = [
            f"tensor_parallel_size {self.tensor_parallel}",
            f"pipeline_parallel_size {self.pipeline_parallel}" + (" over Ray" if self.ray else ""),
            f"max_model_len {self.max_model_len:,}",
            kv,
            f"max_num_seqs {self.max_num_seqs}",
            f"dtype {VLLM_DTYPES[self.dtype]}" + (f" with {self.quantization} weights" if self.quantization else ""),
            f"prefix caching {'on' if self.prefix_caching else 'off'}",
        ]
        if self.max_lora_rank:
            parts.append(f"LoRA: max_lora_rank {self.max_lora_rank}, {len(self.lora_modules)} module(s)")
        return "vLLM: " + ", ".join(parts)


def cpu_kv_gib(tokens: int, bytes_per_token: float) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` (whole GiB) for a KV budget of `tokens`."""
    return max(1, math.ceil(tokens * bytes_per_token / 2**30))


NODE_GPUS = 8  # GPUs in one node (an HGX/DGX board): a layout wider than that spans nodes, over Ray
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def serving_plan(result: dict, model_ref: str, source: str, gen: int, kind: str) -> dict:
    """`gpuwise plan --task inference`: the engine `gpuwise serve --engine auto` would pick on the accelerator
    the plan recommends, and vLLM's command line set from the plan (the same knobs `gpuwise serve` sets)."""
    device = "cpu" if kind == "cpu" else "cuda"
    engine, why = auto_engine(device, vllm_found=True)
    if device == "cuda":
        why = "auto: a CUDA device, once vLLM is installed there (CUDA graphs, paged attention)"
    out: dict = {"engine": engine, "why": why, "vllm": None, "command": None}
    precision = result["precision"]
    if precision not in (*VLLM_DTYPES, "fp8"):
        out["why"] += f"; vLLM serves {precision} only from weights quantized ahead (AWQ, GPTQ): no command given"
        return out
    layout = result["layout"]
    model = source if HUB_ID.fullmatch(source) else model_ref
    args = VLLMArgs(
        model=model,
        served_name=result["model"]["name"],
        dtype="bf16" if precision == "fp8" else precision,
        quantization="fp8" if precision == "fp8" else None,
        max_model_len=result["seq"] + gen,
        max_num_seqs=max(result["batch"], result.get("max_batch") or 1),
        device=device,
        tensor_parallel=layout.get("tp", 1) or 1,
        pipeline_parallel=layout.get("pp", 1) or 1,
        kv_cache_gib=cpu_kv_gib(result["max_batch"] * (result["seq"] + gen), result["kv_cache_per_token"])
        if device == "cpu" and result.get("max_batch") and result.get("kv_cache_per_token")
        else None,
        eager=device == "cpu",
    )
    out["vllm"], out["command"] = args.args(), args.command()
    out["summary"] = args.summary()
    return out
