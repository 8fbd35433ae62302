"""What a model family is to the loaders and the engine: ``Family``.

A family names the architectures it reads (GGUF ``general.architecture``, Hugging Face
``model_type`` / ``architectures``), fills a ``ModelConfig`` from either kind of file, names its
weights (GGUF tensor names to Hugging Face ones, and the shapes a checkpoint must hold) and builds
its ``Decoder``. The registry of families is kvserve/model/families.py; docs/design.md, "How to
add a model family", walks through adding one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import ModelConfig
from kvserve.model.decoder import Decoder


class GGUFKeys:
    """A GGUF file's metadata as a family reads it: ``arch(name)`` is ``{architecture}.{name}``."""

    def __init__(self, fields: Mapping[str, Any], architecture: str, source: str,
                 tensor_shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.fields, self.architecture, self.source = fields, architecture, source
        self.tensor_shapes = tensor_shapes        # GGUF names, dims innermost first

    def get(self, name: str, default: Any = None) -> Any:
        value = self.fields.get(name)
        return default if value is None else value

    def arch(self, name: str, default: Any = None) -> Any:
        """``{architecture}.{name}``; ValueError when it is missing and there is no default."""
        value = self.fields.get(f"{self.architecture}.{name}")
        if value is None and default is None:
            raise ValueError(f"GGUF file {self.source!r} lacks metadata key {self.architecture}.{name!r}.")
        return default if value is None else value

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry ``text``, if the file's vocabulary has it."""
        tokens = self.fields.get("tokenizer.ggml.tokens") or []
        try:
            return list(tokens).index(text)
        except ValueError:
            return None


@dataclass(frozen=True)
class Family:
    """One model family. ``gguf_config`` / ``hf_config`` get the fields every family shares, as
    keyword arguments of ``ModelConfig`` already read, and return the config with the family's
    own (its layers' specs, norms, activation ...). ``gguf_layer_names`` maps a GGUF layer
    tensor's leaf (``attn_q``) to its Hugging Face name under ``model.layers.N.``;
    ``layer_weight_shapes`` gives, for one layer, every weight it must hold (names under
    ``model.layers.N.``, Hugging Face shapes). ``gguf_norm_shift`` is added to every norm weight
    read from a GGUF file (llama.cpp stores Gemma's norms as 1 + weight). ``to_hf_config``: the
    config.json of the transformers model that computes what ours does (the baselines and
    references of benchmarks, eval and tests; ``hf_config`` reads it back). ``permutes_qk_rows``:
    llama.cpp stored Q and K rows interleaved (the llama architecture), which the loader undoes."""

    name: str
    decoder: type[Decoder]
    gguf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    gguf_layer_names: Mapping[str, str]
    layer_weight_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    gguf_config: Callable[[GGUFKeys, dict[str, Any]], ModelConfig]
    hf_config: Callable[[dict[str, Any], dict[str, Any], str], ModelConfig]
    to_hf_config: Callable[[ModelConfig], dict[str, Any]] = field(default=lambda config: {})
    gguf_norm_shift: float = 0.0
    permutes_qk_rows: Callable[[str], bool] = field(default=lambda architecture: False)
    chat_template: str | None = None          # for files that carry none

    def hf_config_dict(self, config: ModelConfig) -> dict[str, Any]:
        """``to_hf_config`` with the fields every family shares."""
        return {
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids) or None,
        } | self.to_hf_config(config)

    def expected_weight_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint of this family must provide, with its Hugging Face shape."""
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
            "model.norm.weight": (config.hidden_size,),
        }
        layer = self.layer_weight_shapes(config)
        for i in range(config.num_layers):
            shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        return shapes
