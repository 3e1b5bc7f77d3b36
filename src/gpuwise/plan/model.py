"""A model's shape, from a preset, a Hugging Face ``config.json`` or explicit dimensions.

The planner needs only the dimensions, never the weights: parameter counts follow from them
exactly (a test holds every preset to its published count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from gpuwise.errors import GpuwiseError, closest
from gpuwise.plan.presets import PRESETS


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


def _from_dims(text: str) -> ModelSpec:
    known = {f.name: f.type for f in fields(ModelSpec) if f.name not in ("name", "published_params")}
    aliases = {"n_layers": "layers", "d_model": "hidden", "n_heads": "heads", "intermediate": "ffn"}
    values: dict = {}
    for part in text.split(","):
        key, _, raw = part.partition("=")
        key = aliases.get(key.strip(), key.strip())
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
            if not raw.isdigit() or int(raw) <= 0:
                raise GpuwiseError(f"model dimension '{key}': '{raw}' is not a positive integer")
            values[key] = int(raw)
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in values]
    if missing:
        raise GpuwiseError(f"explicit model dimensions lack {', '.join(missing)}")
    values.setdefault("kv_heads", values["heads"])
    values.setdefault("head_dim", values["hidden"] // values["heads"])
    values.setdefault("family", "custom")
    return _checked(ModelSpec(name="custom", **values))


def _checked(spec: ModelSpec) -> ModelSpec:
    if spec.heads % spec.kv_heads:
        raise GpuwiseError(f"{spec.name}: heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_heads})")
    return spec


def from_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face config.json (a file or a model directory)."""
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise GpuwiseError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise GpuwiseError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise GpuwiseError(f"{path}: not a UTF-8 text file (a config.json is expected)") from None
    if not isinstance(cfg, dict):
        raise GpuwiseError(f"{path}: a config.json holds one JSON object")
    kind = cfg.get("model_type", "")
    name = cfg.get("_name_or_path") or path.parent.name or kind

    def need(*keys):
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        raise GpuwiseError(f"{path}: model_type '{kind}' lacks '{keys[0]}'")

    if kind in ("llama", "mistral", "qwen2", "gemma", "gemma2"):
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=need("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            ffn=need("intermediate_size"),
            vocab=need("vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", kind.startswith("gemma"))),
            norms_per_layer=4 if kind == "gemma2" else 2,
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_seq=cfg.get("max_position_embeddings", 0),
        )
    elif kind == "gpt2":
        hidden = need("n_embd")
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=need("n_layer"),
            hidden=hidden,
            heads=need("n_head"),
            kv_heads=need("n_head"),
            head_dim=hidden // need("n_head"),
            ffn=cfg.get("n_inner") or 4 * hidden,
            vocab=need("vocab_size"),
            tied=True,
            gated=False,
            norm_bias=True,
            linear_bias=True,
            positions=need("n_positions"),
            dropout=True,
            max_seq=need("n_positions"),
        )
    elif kind == "bert":
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        spec = ModelSpec(
            name=name,
            family=kind,
            layers=need("num_hidden_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            ffn=need("intermediate_size"),
            vocab=need("vocab_size"),
            gated=False,
            norm_bias=True,
            linear_bias=True,
            positions=need("max_position_embeddings"),
            token_types=cfg.get("type_vocab_size", 2),
            pooler=True,
            causal=False,
            dropout=True,
            max_seq=need("max_position_embeddings"),
        )
    else:
        supported = "llama, mistral, qwen2, gemma, gemma2, gpt2, bert"
        raise GpuwiseError(
            f"{path}: model_type '{kind}' is not supported (supported: {supported}); "
            "give explicit dimensions instead (layers=..,hidden=..,heads=..,ffn=..,vocab=..)"
        )
    return _checked(spec)


def resolve_model(text: str) -> ModelSpec:
    """MODEL as the CLI takes it: a preset name, a config.json path, or key=value dimensions."""
    key = text.strip().lower()
    if key in PRESETS:
        return ModelSpec(name=key, **PRESETS[key])
    if "=" in text:
        return _from_dims(text)
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".json"):
        return from_hf_config(path)
    raise GpuwiseError(
        f"unknown model '{text}'{closest(key, PRESETS)}; give a preset "
        "(see `gpuwise plan --help`), a config.json path, or dimensions like layers=32,hidden=4096,..."
    )
