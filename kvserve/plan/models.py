"""Model shapes for planning: a built-in table of common models, or read from a config.

The attention shape (layers, KV heads, head dim) is what KV memory needs; the MLP width, the
vocabulary and whether the LM head is tied to the embedding are what the weights need. The table
holds the published config.json values of each model (base and instruct variants share them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvserve.config import ModelConfig

if TYPE_CHECKING:
    from kvserve.model.loaded import LoadedModel


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder. ``max_context``, ``intermediate_size``, ``vocab_size`` and
    ``tie_word_embeddings`` are None when the source does not say; ``attention_bias``: Q/K/V
    have biases (Qwen2)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int | None
    note: str = ""
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    attention_bias: bool = False
    windows: tuple[int | None, ...] = ()      # each layer's sliding window (None: full); empty: all full

    def __post_init__(self) -> None:
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.windows)} windows for {self.num_layers} layers")
        for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        for field in ("intermediate_size", "vocab_size"):
            if getattr(self, field) is not None and getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.max_context is not None and self.max_context <= 0:
            raise ValueError(f"{self.name}: max_context must be positive, got {self.max_context}")

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend over a sliding window (they hold only its blocks)."""
        return tuple(i for i, w in enumerate(self.windows) if w is not None)

    @property
    def attention(self) -> str:
        """``MHA``, ``MQA`` or ``GQA 8:1`` (query heads per KV head)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return f"GQA {self.num_heads // self.num_kv_heads}:1"

    @classmethod
    def from_model_config(cls, config: ModelConfig, name: str | None = None) -> ModelShape:
        return cls(name or config.architecture, config.num_layers, config.num_heads, config.num_kv_heads,
                   config.head_dim, config.hidden_size, config.max_position_embeddings,
                   intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                   tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
                   windows=config.sliding_windows if config.has_sliding_layers else ())


# name, layers, heads, KV heads, head dim, hidden, MLP width, vocabulary, tied LM head, max context
# (the model card's context length), note. Qwen2 models have Q/K/V biases.
_TABLE: tuple[tuple[str, int, int, int, int, int, int, int, bool, int, str], ...] = (
    ("Llama-2-7B", 32, 32, 32, 128, 4096, 11008, 32000, False, 4096, ""),
    ("Llama-2-13B", 40, 40, 40, 128, 5120, 13824, 32000, False, 4096, ""),
    ("Llama-2-70B", 80, 64, 8, 128, 8192, 28672, 32000, False, 4096, ""),
    ("Llama-3-8B", 32, 32, 8, 128, 4096, 14336, 128256, False, 8192, ""),
    ("Llama-3-70B", 80, 64, 8, 128, 8192, 28672, 128256, False, 8192, ""),
    ("Mistral-7B", 32, 32, 8, 128, 4096, 14336, 32000, False, 32768,
     "v0.1 attends over a 4,096-token sliding window; planned here as full attention"),
    ("Qwen2-0.5B", 24, 14, 2, 64, 896, 4864, 151936, True, 32768,
     "the base config.json says 131,072; the card 32,768"),
    ("Qwen2-1.5B", 28, 12, 2, 128, 1536, 8960, 151936, True, 32768,
     "the base config.json says 131,072; the card 32,768"),
    ("Qwen2-7B", 28, 28, 4, 128, 3584, 18944, 152064, False, 131072, "contexts over 32,768 need YaRN rope scaling"),
    ("Qwen2-72B", 80, 64, 8, 128, 8192, 29568, 152064, False, 131072, "contexts over 32,768 need YaRN rope scaling"),
    ("SmolLM2-135M", 30, 9, 3, 64, 576, 1536, 49152, True, 8192, "the engine's default model"),
    ("SmolLM2-360M", 32, 15, 5, 64, 960, 2560, 49152, True, 8192, ""),
    ("SmolLM2-1.7B", 24, 32, 32, 64, 2048, 8192, 49152, True, 8192, ""),
)


def _table_shape(row: tuple[str, int, int, int, int, int, int, int, bool, int, str]) -> ModelShape:
    name, layers, heads, kv_heads, head_dim, hidden, ffn, vocab, tied, context, note = row
    return ModelShape(name, layers, heads, kv_heads, head_dim, hidden, context, note, intermediate_size=ffn,
                      vocab_size=vocab, tie_word_embeddings=tied, attention_bias=name.startswith("Qwen2"))


def _gemma3(name: str, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int, context: int,
            window: int) -> ModelShape:
    """Gemma 3 (head dim 256, a 262,144-token tied embedding): every sixth layer attends to the
    whole context, the others over a window of ``window`` positions."""
    return ModelShape(name, layers, heads, kv_heads, 256, hidden, context, f"sliding window {window} on 5 of 6 "
                      "layers", intermediate_size=ffn, vocab_size=262144, tie_word_embeddings=True,
                      windows=tuple(None if (i + 1) % 6 == 0 else window for i in range(layers)))


BUILTIN_MODELS: MappingProxyType[str, ModelShape] = MappingProxyType({
    **{row[0]: _table_shape(row) for row in _TABLE},
    "Gemma-3-270M": _gemma3("Gemma-3-270M", 18, 4, 1, 640, 2048, 32768, 512),
    "Gemma-3-1B": _gemma3("Gemma-3-1B", 26, 4, 1, 1152, 6912, 32768, 512)})

# Suffixes of published repository names that do not change the shape.
_VARIANT_SUFFIXES = ("-hf", "-instruct", "-chat", "-it", "-base", "-v0.1", "-v0.2", "-v0.3")


def normalize_model_name(name: str) -> str:
    """``meta-llama/Meta-Llama-3-70B-Instruct`` -> ``llama-3-70b``; ``Llama2-7b-chat-hf`` ->
    ``llama-2-7b``; ``Qwen/Qwen2-7B-Instruct`` -> ``qwen2-7b``."""
    n = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(":", "-")
    n = re.sub(r"^meta-", "", n)
    n = re.sub(r"^llama(\d)", r"llama-\1", n)
    stripped = True
    while stripped:
        stripped = False
        for suffix in _VARIANT_SUFFIXES:
            if n.endswith(suffix):
                n, stripped = n[: -len(suffix)], True
    return n


_BY_NORMALIZED: MappingProxyType[str, ModelShape] = MappingProxyType(
    {normalize_model_name(name): shape for name, shape in BUILTIN_MODELS.items()})


def lookup_model(name: str) -> ModelShape | None:
    """The built-in model ``name`` names (case-insensitive, org prefix and -Instruct/-chat/-hf
    suffixes ignored), or None."""
    return _BY_NORMALIZED.get(normalize_model_name(name))


def shape_from_hf_config(raw: dict[str, Any], name: str) -> ModelShape:
    """A shape from a Hugging Face config.json: num_hidden_layers, num_attention_heads,
    num_key_value_heads (default: the heads), head_dim (default: hidden_size / heads); for the
    weights intermediate_size, vocab_size, tie_word_embeddings (None where absent) and Q/K/V
    biases (Qwen2, or attention_bias: as the engine's loader reads them)."""
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in raw]
    if missing:
        raise ValueError(f"{name} lacks {missing}; is it a decoder's config.json?")
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // heads
    max_context = raw.get("max_position_embeddings")
    ffn, vocab, tied = raw.get("intermediate_size"), raw.get("vocab_size"), raw.get("tie_word_embeddings")
    layer_types = raw.get("layer_types") or []
    window = raw.get("sliding_window")
    windows: tuple[int | None, ...] = ()
    if window and len(layer_types) == int(raw["num_hidden_layers"]):      # Gemma 3's config.json
        windows = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return ModelShape(name=name, num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
                      num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=int(head_dim),
                      hidden_size=hidden, max_context=int(max_context) if max_context else None,
                      intermediate_size=int(ffn) if ffn else None, vocab_size=int(vocab) if vocab else None,
                      tie_word_embeddings=None if tied is None else bool(tied),
                      attention_bias=raw.get("model_type") == "qwen2" or bool(raw.get("attention_bias", False)),
                      windows=windows)


def load_model_shape(path: str | Path) -> ModelShape:
    """A shape from a config.json, a Hugging Face model directory, or a .gguf file (whose config
    comes from ``kvserve.model.loader.load_model``)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"{str(p)!r} is not a file; expected a config.json, a model directory or a .gguf file")
    if p.suffix == ".gguf":
        return load_gguf(p)[0]
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(p)!r} as a JSON config: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{str(p)!r} holds no JSON object")  # noqa: TRY004 -- bad input, not a bad call
    return shape_from_hf_config(raw, raw.get("_name_or_path") or p.parent.name or str(p))


def load_gguf(path: str | Path) -> tuple[ModelShape, LoadedModel]:
    """A .gguf file's shape and its loaded weights (``kvserve.model.loader.load_model``: the
    converted-weights cache makes this about a second after the first time)."""
    from kvserve.model.loader import load_model  # torch and the GGUF loader only when needed

    p = Path(path).expanduser()
    loaded = load_model(str(p))
    return ModelShape.from_model_config(loaded.config, name=p.stem), loaded


def resolve_model(model: str | ModelShape | ModelConfig) -> ModelShape:
    """A built-in name or alias, a path (see ``load_model_shape``), a ``ModelConfig`` or a shape."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return ModelShape.from_model_config(model)
    shape = lookup_model(model)
    if shape is not None:
        return shape
    if Path(model).expanduser().exists():
        return load_model_shape(model)
    raise ValueError(f"unknown model {model!r}: not a built-in model ({', '.join(BUILTIN_MODELS)}) "
                     "and not a path to a config.json, a model directory or a .gguf file")
