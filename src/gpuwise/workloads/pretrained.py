"""Open pretrained LLMs as a fine-tune's base: a named base (a file an installed package ships), a `.gguf`
file, a local Hugging Face directory, or a hub id.

transformers reads a GGUF file (`gguf_file=`) but dequantizing it takes 20-30 s here, and a GGUF-loaded
model refuses `save_pretrained`. So a GGUF base is converted once, into safetensors in gpuwise's cache
(`GPUWISE_CACHE`, else the user cache dir), keyed by the file's SHA-256, and loaded from there (~1 s).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from pathlib import Path

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.model import ModelSpec, read_gguf_header

SCRATCH = "scratch"  # the small Llama built from a config, with a tokenizer trained on the data


def cache_root() -> Path:
    """Where converted bases, engine builds and kernels are kept: GPUWISE_CACHE, else the platform's user cache
    dir. Made 0700 where it is missing: no one else has anything to read in it."""
    if os.environ.get("GPUWISE_CACHE"):
        root = Path(os.environ["GPUWISE_CACHE"])
    else:
        import platformdirs

        root = Path(platformdirs.user_cache_dir("gpuwise"))
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
    return root


def _check_gguf(path: Path) -> None:
    """The header read by gpuwise's own bounded reader (depth, counts and lengths checked against the file)
    before gguf's reader, which trusts them, maps the file."""
    if not path.exists():
        raise GpuwiseError(f"--base {path}: no such file")
    try:
        read_gguf_header(path)
    except GpuwiseError as e:
        raise GpuwiseError(f"--base {e}") from None


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def convert_gguf(path: Path) -> Path:
    """A from_pretrained-ready directory (config, safetensors, tokenizer) converted once from a GGUF file."""
    _check_gguf(path)
    target = cache_root() / "bases" / f"{path.stem}-{_digest(path)[:16]}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - gguf and transformers raise many types for a bad file
        raise GpuwiseError(f"--base {path}: cannot read the model in this GGUF file ({first_line(e)})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # dequantized on load: what is saved is plain float weights
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    # Written under a temp name and renamed: a crash leaves no half-converted base, and two runs
    # converting at once each write their own and the second rename loses harmlessly.
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    try:
        os.rename(tmp, target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_base(spec: str, flag: str = "--base") -> str:
    """What from_pretrained loads for `--base SPEC`: a local directory for a named base, a `.gguf` file or a
    model directory; the spec itself for a hub id. One line for anything that cannot be a base."""
    if spec in NAMED_BASES:
        return str(convert_gguf(named_base_path(spec)))
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise GpuwiseError(f"{flag} {spec}: a directory without config.json is not a model")
        return str(path)
    if path.exists():
        raise GpuwiseError(f"{flag} {spec}: not a model directory, a .gguf file or a named base")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise GpuwiseError(f"{flag} {spec}: no such file or directory")
    hub_reachable(spec, flag)
    return spec  # a hub id: from_pretrained fetches it where a hub is reachable


def hub_reachable(repo: str, flag: str = "--base") -> None:
    """A hub id that the local hub cache lacks is fetched by from_pretrained; where the hub cannot be reached
    (offline, HF_HUB_OFFLINE), say so in one line now, not after huggingface_hub's retries (about 50 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo, "config.json"), str):
            return  # cached: from_pretrained reads it without a network
    except ValueError:  # not a valid repo id: from_pretrained says why
        return
    where = f"the local hub cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise GpuwiseError(f"{flag} {repo}: not in {where}, and HF_HUB_OFFLINE is set")
    url = urlparse(constants.ENDPOINT)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "", port), timeout=5).close()
    except OSError as e:
        raise GpuwiseError(
            f"{flag} {repo}: not in {where}, and {url.hostname} cannot be reached ({e.strerror or e}): download it "
            f"where there is a network (`hf download {repo}`), or point HF_HOME at a cache that has it"
        ) from None


def quiet_transformers() -> None:
    import logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # bitsandbytes tries to fetch an optional CPU kernel from the hub at import and warns when it can't;
    # nothing is fetched at run time here, and its built-in CPU path is what we use.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # huggingface_hub logs each retry of an unreachable hub as a warning; the error that follows says it once.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # peft (0.x) still probes the old attribute name; the warning is theirs to act on, not the user's.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def spec_of(model, name: str = "model"):
    """The analytic planner's view of the model, from its config."""
    c = model.config
    heads = c.num_attention_heads
    return ModelSpec(
        name=name,
        family=c.model_type,
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        ffn=c.intermediate_size,
        vocab=c.vocab_size,
        tied=bool(c.tie_word_embeddings),
    )


def fake_tensors(model):
    """`model`, built on the meta device, with every parameter and buffer a fake CPU tensor of its shape and dtype
    (torch's FakeTensorMode, real inputs allowed): one training step runs on it, counted and traced, and nothing
    is allocated. Tied weights stay tied; what a parameter says of its storage (`stored_bytes`) is kept. Replaced
    in place, not through `Module.to`, which cannot swap a parameter for a fake one."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(module, kind)
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in made:
                        fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                        if isinstance(t, torch.nn.Parameter):
                            fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
                            if hasattr(t, "stored_bytes"):
                                fake.stored_bytes = t.stored_bytes  # type: ignore[attr-defined]
                        made[id(t)] = fake
                    table[name] = made[id(t)]
    return model
