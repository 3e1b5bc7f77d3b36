"""A model's shape, from a preset, a Hugging Face ``config.json`` or explicit dimensions.

The planner needs only the dimensions, never the weights: parameter counts follow from them
exactly (a test holds every preset to its published count).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest
from gpuwise.files import read_text_file
from gpuwise.plan.bases import NAMED_BASES, named_base_path
from gpuwise.plan.gguf import GGUFArray, read_gguf_header
from gpuwise.plan.gguf import shown as _shown
from gpuwise.plan.presets import PRESETS

__all__ = ["GGUFArray", "ModelSpec", "from_gguf", "from_hf_config", "read_gguf_header", "resolve_model"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True  # SwiGLU/GeGLU: three hidden x ffn matrices instead of two
    norms_per_layer: int = 2  # Gemma 2 has four (pre and post norm around each block)
    norm_bias: bool = False  # LayerNorm (GPT-2, BERT) vs RMSNorm
    linear_bias: bool = False  # a bias on every linear layer (GPT-2, BERT)
    qkv_bias: bool = False  # Qwen2: biases on q, k and v only
    positions: int = 0  # learned absolute position embeddings (0: rotary)
    token_types: int = 0  # BERT segment embeddings
    pooler: bool = False  # BERT's pooler dense layer
    causal: bool = True  # decoder-only LM (has a KV cache and an LM head)
    dropout: bool = False  # dropout masks kept for backward (Korthikanti's accounting)
    max_seq: int = 0
    published_params: float | None = None
    source: str = ""  # where the dimensions come from (a Hugging Face repo id, a file)
    notes: str = ""  # what the planner does not model about this architecture

    # --- parameter counts -------------------------------------------------------------
    @property
    def attn_matrices(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each attention projection, as LoRA sees them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": (self.hidden, q), "k": (self.hidden, kv), "v": (self.hidden, kv), "o": (q, self.hidden)}

    @property
    def mlp_matrices(self) -> dict[str, tuple[int, int]]:
        h, f = self.hidden, self.ffn
        if self.gated:
            return {"gate": (h, f), "up": (h, f), "down": (f, h)}
        return {"up": (h, f), "down": (f, h)}

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's linear matrices (what NF4 quantizes and LoRA adapts)."""
        mats = list(self.attn_matrices.values()) + list(self.mlp_matrices.values())
        return sum(i * o for i, o in mats)

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = self.layer_linear_params
        if self.linear_bias:
            n += q + 2 * kv + h + sum(o for _, o in self.mlp_matrices.values())
        elif self.qkv_bias:
            n += q + 2 * kv
        return n + self.norms_per_layer * h * (2 if self.norm_bias else 1)

    @property
    def embedding_params(self) -> int:
        h = self.hidden
        n = (self.vocab + self.positions + self.token_types) * h
        return n + (2 * h if not self.causal else 0)  # BERT normalizes its embeddings

    @property
    def head_params(self) -> int:
        """Final norm, LM head (unless tied to the embedding) and pooler."""
        h = self.hidden
        n = h * (2 if self.norm_bias else 1) if self.causal else 0
        if self.causal and not self.tied:
            n += self.vocab * h
        if self.pooler:
            n += h * h + h
        return n

    @property
    def params(self) -> int:
        return self.embedding_params + self.layers * self.layer_params + self.head_params

    @property
    def compute_params(self) -> int:
        """Parameters that take part in matmuls per token: the input embedding is a lookup,
        but a tied embedding is also the LM head and so counts once."""
        lookup = (self.vocab + self.positions + self.token_types) * self.hidden
        shared = self.vocab * self.hidden if (self.causal and self.tied) else 0
        return self.params - lookup + shared

    def kv_cache_per_token(self, bytes_per_value: float) -> float:
        """Keys and values of every layer for one token (GQA: kv_heads, not heads)."""
        if not self.causal:
            return 0.0
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


# The range of each whole-number dimension. The highs lie far beyond any published model (the largest dense
# ones: 126 layers, hidden 16384, FFN 53248, vocabulary 256000, context 10 M) and refuse a unit slip such as
# 1e30 layers before it becomes a plan; every low is 1, since a zero divides or makes an empty model.
LIMITS: dict[str, int] = {
    "layers": 10_000,
    "hidden": 2**20,
    "heads": 2**16,
    "kv_heads": 2**16,
    "head_dim": 2**16,
    "ffn": 2**22,
    "vocab": 2**24,
    "positions": 2**30,
    "token_types": 2**16,
    "max_seq": 2**30,
    "norms_per_layer": 16,
}


def _whole(where: str, key: str, field: str, value) -> int:
    """A dimension as a whole number in its range, or one line naming the key and what it holds."""
    high = LIMITS[field]
    # JSON has one number type: 32.0 is a whole number, 2.5, true, "32" and null are not.
    whole = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(whole, bool) or not isinstance(whole, int) or not 1 <= whole <= high:
        raise GpuwiseError(f"{where}'{key}' must be a whole number from 1 to {high:,}, not {_shown(value)}")
    return whole


def _from_dims(text: str) -> ModelSpec:
    skip = ("name", "published_params", "source", "notes")
    known = {f.name: f.type for f in fields(ModelSpec) if f.name not in skip}
    aliases = {"n_layers": "layers", "d_model": "hidden", "n_heads": "heads", "intermediate": "ffn"}
    values: dict = {}
    for part in text.split(","):
        key, _, raw = part.partition("=")
        key = aliases.get(key.strip(), key.strip())
        if not key:
            raise GpuwiseError(f"model dimensions '{text}': a part names no dimension (a stray comma or '=')")
        if key not in known:
            raise GpuwiseError(
                f"unknown model dimension '{key}'{closest(key, known)}; "
                "use e.g. layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256"
            )
        raw = raw.strip()
        if known[key] == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise GpuwiseError(f"model dimension '{key}': '{raw}' is not true/false")
            values[key] = raw.lower() in ("true", "1", "yes")
        elif known[key] == "str":
            values[key] = raw
        else:
            # Twenty digits already overflow every bound; int() of thousands of them is refused by Python itself.
            whole = raw.isascii() and raw.isdigit() and len(raw) < 20
            values[key] = _whole("model dimension ", key, key, int(raw) if whole else raw)
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in values]
    if missing:
        raise GpuwiseError(f"explicit model dimensions lack {', '.join(missing)}")
    values.setdefault("kv_heads", values["heads"])
    if "head_dim" not in values:
        values["head_dim"] = _head_dim("model dimensions", "hidden", values["hidden"], "heads", values["heads"])
    values.setdefault("family", "custom")
    return _checked(ModelSpec(name="custom", **values))


def _head_dim(where: str, hidden_key: str, hidden: int, heads_key: str, heads: int) -> int:
    """hidden / heads when no head_dim is given: it must come out whole (and at least 1)."""
    if hidden % heads:
        raise GpuwiseError(
            f"{where}: {heads_key} {heads} does not divide {hidden_key} {hidden} (give head_dim if heads are not "
            "hidden / heads wide)"
        )
    return hidden // heads


def _checked(spec: ModelSpec) -> ModelSpec:
    if spec.heads % spec.kv_heads:
        raise GpuwiseError(f"{spec.name}: heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_heads})")
    return spec


def from_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face config.json (a file or a model directory)."""
    if path.is_dir():
        path = path / "config.json"
    text = read_text_file(path, "model config", "a config.json")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise GpuwiseError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:  # [[[[...]]]] nested deeper than the parser recurses
        raise GpuwiseError(f"{path}: not a config.json (nested too deep)") from None
    if not isinstance(cfg, dict):
        raise GpuwiseError(f"{path}: a config.json holds one JSON object")
    kind = cfg.get("model_type", "")
    kind = kind if isinstance(kind, str) else _shown(kind)
    named = cfg.get("_name_or_path")
    name = named if isinstance(named, str) and named.strip() else path.parent.name or kind

    def num(field: str, key: str, default: int | None = None) -> int:
        if cfg.get(key) is not None:
            return _whole(f"{path}: ", key, field, cfg[key])
        if default is None:
            raise GpuwiseError(f"{path}: model_type '{kind}' lacks '{key}'")
        return default

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise GpuwiseError(f"{path}: '{key}' must be true or false, not {_shown(value)}")
        return value

    if kind in ("llama", "mistral", "qwen2", "gemma", "gemma2"):
        hidden, heads = num("hidden", "hidden_size"), num("heads", "num_attention_heads")
        head_dim = num("head_dim", "head_dim", 0) or _head_dim(
            str(path), "hidden_size", hidden, "num_attention_heads", heads
        )
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=num("layers", "num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=num("kv_heads", "num_key_value_heads", heads),
            head_dim=head_dim,
            ffn=num("ffn", "intermediate_size"),
            vocab=num("vocab", "vocab_size"),
            tied=flag("tie_word_embeddings", kind.startswith("gemma")),
            norms_per_layer=4 if kind == "gemma2" else 2,
            qkv_bias=kind == "qwen2" or flag("attention_bias", False),
            max_seq=num("max_seq", "max_position_embeddings", 0),
        )
    elif kind == "gpt2":
        hidden, heads = num("hidden", "n_embd"), num("heads", "n_head")
        positions = num("positions", "n_positions")
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=num("layers", "n_layer"),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=_head_dim(str(path), "n_embd", hidden, "n_head", heads),
            ffn=num("ffn", "n_inner", 4 * hidden),
            vocab=num("vocab", "vocab_size"),
            tied=True,
            gated=False,
            norm_bias=True,
            linear_bias=True,
            positions=positions,
            dropout=True,
            max_seq=positions,
        )
    elif kind == "bert":
        hidden, heads = num("hidden", "hidden_size"), num("heads", "num_attention_heads")
        positions = num("positions", "max_position_embeddings")
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=num("layers", "num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=_head_dim(str(path), "hidden_size", hidden, "num_attention_heads", heads),
            ffn=num("ffn", "intermediate_size"),
            vocab=num("vocab", "vocab_size"),
            gated=False,
            norm_bias=True,
            linear_bias=True,
            positions=positions,
            token_types=num("token_types", "type_vocab_size", 2),
            pooler=True,
            causal=False,
            dropout=True,
            max_seq=positions,
        )
    else:
        supported = "llama, mistral, qwen2, gemma, gemma2, gpt2, bert"
        raise GpuwiseError(
            f"{path}: model_type '{kind}' is not supported (supported: {supported}); "
            "give explicit dimensions instead (layers=..,hidden=..,heads=..,ffn=..,vocab=..)"
        )
    return _checked(spec)


# The architectures whose GGUF tensors map onto ModelSpec (llama.cpp writes Mistral 7B as llama).
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "gemma": "gemma", "gemma2": "gemma2"}


def from_gguf(path: Path, name: str | None = None) -> ModelSpec:
    """A model's dimensions from a GGUF file's header (the weights are not read)."""
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GpuwiseError(f"{path}: the GGUF header names no general.architecture")
    if arch not in _GGUF_ARCHS:
        raise GpuwiseError(
            f"{path}: GGUF architecture {_shown(arch)} cannot be planned (supported: "
            f"{', '.join(_GGUF_ARCHS)}); give explicit dimensions instead "
            "(layers=..,hidden=..,heads=..,ffn=..,vocab=..)"
        )
    family = _GGUF_ARCHS[arch]

    def num(field: str, key: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise GpuwiseError(f"{path}: the GGUF header lacks {arch}.{key}")
            return default
        if isinstance(value, GGUFArray):  # per-layer values (OpenELM-style): one width is all ModelSpec has
            raise GpuwiseError(f"{path}: {arch}.{key} differs per layer, which gpuwise cannot plan")
        return _whole(f"{path}: ", f"{arch}.{key}", field, value)

    hidden, heads = num("hidden", "embedding_length"), num("heads", "attention.head_count")
    head_dim = num("head_dim", "attention.key_length", 0) or _head_dim(
        str(path), "embedding_length", hidden, "attention.head_count", heads
    )
    # The vocabulary is what the embedding holds (converters pad the token list up to it); else the token list.
    embedding = tensors.get("token_embd.weight")
    tokens = meta.get("tokenizer.ggml.tokens")
    if embedding is not None and len(embedding) == 2:
        vocab = _whole(f"{path}: ", "token_embd.weight", "vocab", embedding[1])
    elif isinstance(tokens, GGUFArray):
        vocab = _whole(f"{path}: ", "tokenizer.ggml.tokens", "vocab", tokens.length)
    else:
        vocab = num("vocab", "vocab_size")
    return _checked(
        ModelSpec(
            name=name or path.name,
            family=family,
            layers=num("layers", "block_count"),
            hidden=hidden,
            heads=heads,
            kv_heads=num("kv_heads", "attention.head_count_kv", heads),
            head_dim=head_dim,
            ffn=num("ffn", "feed_forward_length"),
            vocab=vocab,
            tied="output.weight" not in tensors,  # no separate LM head: it is the embedding
            norms_per_layer=4 if family == "gemma2" else 2,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            max_seq=num("max_seq", "context_length", 0),
            source=str(path),
        )
    )


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # a Hugging Face hub id: owner/name
# what a fine-tuned variant adds to its base's name; it keeps the base's dimensions
VARIANT = re.compile(r"-(instruct|chat|it|hf|base)$", re.IGNORECASE)


def _base_id(repo: str) -> str:
    """A hub id without its variant suffixes, lower case: meta-llama/Llama-2-7b-chat-hf -> meta-llama/llama-2-7b."""
    while (shorter := VARIANT.sub("", repo)) != repo:
        repo = shorter
    return repo.lower()


def from_hub(repo: str) -> ModelSpec:
    """A Hugging Face hub id, as `train --base` and `serve` take it: its config.json from the local hub cache; else
    the preset whose source is that model or its base (an instruct or chat variant has its base's dimensions);
    else one line, at once: the plan downloads nothing."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, "config.json")
    except ValueError:  # not a valid repo id after all
        cached = None
    if isinstance(cached, str):
        spec = from_hf_config(Path(cached))
        return replace(spec, name=repo, source=f"{repo} config.json, from the local hub cache")
    base = _base_id(repo)
    for name, preset in PRESETS.items():
        origin = str(preset.get("source", "")).split(" ")[0]
        if origin and _base_id(origin) == base:
            note = f"{repo}: planned as the preset {name} ({origin}), whose dimensions it has"
            return replace(ModelSpec(name=name, **preset), notes="; ".join(filter(None, [note, preset.get("notes")])))
    raise GpuwiseError(
        f"'{repo}' is no file here, and as a Hugging Face hub id it is neither in the local hub cache "
        f"({constants.HF_HUB_CACHE}) nor a preset's model, and gpuwise plan downloads nothing: fetch its "
        f"config.json (`hf download {repo} config.json`) and pass that path, or give a preset or dimensions"
    )


def resolve_model(text: str) -> ModelSpec:
    """MODEL as the CLI takes it: a preset name, a named base, a .gguf or config.json path, or key=value dimensions."""
    key = text.strip().lower()
    if not key:
        raise GpuwiseError("--model is empty: give a preset, a named base, a .gguf or config.json path or dimensions")
    if key in PRESETS:
        return ModelSpec(name=key, **PRESETS[key])
    if key in NAMED_BASES:
        base = NAMED_BASES[key]
        spec = from_gguf(named_base_path(key), name=key)
        return replace(spec, published_params=base.params, source=f"{base.source} ({base.license}), via {base.package}")
    if "=" in text:
        return _from_dims(text)
    shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
    try:
        path = Path(text).expanduser()
        found = path.exists()
    except RuntimeError:  # ~user of no such user
        raise GpuwiseError(f"cannot read model file {shown}: no such user's home directory") from None
    except OSError as e:  # a name too long, a path through a file the user cannot search
        raise GpuwiseError(f"cannot read model file {shown}: {e.strerror}") from None
    if text.lower().endswith(".gguf"):
        if not found:
            raise GpuwiseError(f"cannot read GGUF file {shown}: no such file")
        return from_gguf(path)
    if found or text.endswith(".json"):
        return from_hf_config(path)
    if HUB_ID.match(text.strip()):
        return from_hub(text.strip())
    known = list(PRESETS) + list(NAMED_BASES)
    raise GpuwiseError(
        f"unknown model '{shown}'{closest(key, known)}; give a preset or named base "
        "(see `gpuwise plan --help`), a .gguf or config.json path, or dimensions like layers=32,hidden=4096,..."
    )
