"""The registry of model families, keyed by the architecture names files carry.

    GGUF  general.architecture      llama, qwen2 -> llama;  gemma3 -> gemma3
    HF    model_type / architectures llama, mistral, qwen2 -> llama;  gemma3_text -> gemma3

``ModelConfig.architecture`` keeps the file's own name (GGUF architecture or HF model_type);
``family_of`` maps it back. Adding a family: docs/design.md, "How to add a model family".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from kvserve.config import ModelConfig
from kvserve.model.decoder import Decoder
from kvserve.model.family import Family
from kvserve.model.gemma3 import GEMMA3
from kvserve.model.linear import Products, Weight
from kvserve.model.llama import LLAMA

FAMILIES: Mapping[str, Family] = MappingProxyType({f.name: f for f in (LLAMA, GEMMA3)})


def _by(names: str) -> dict[str, Family]:
    return {name: f for f in FAMILIES.values() for name in getattr(f, names)}


_GGUF, _HF_TYPES, _HF_ARCHS = _by("gguf_architectures"), _by("hf_model_types"), _by("hf_architectures")


def gguf_family(architecture: object, source: str) -> Family:
    family = _GGUF.get(architecture) if isinstance(architecture, str) else None
    if family is None:
        raise ValueError(f"GGUF file {source!r} has architecture {architecture!r}; supported: {sorted(_GGUF)}.")
    return family


def hf_family(model_type: object, architectures: Sequence[str], source: str) -> Family:
    family = _HF_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None or (architectures and not any(_HF_ARCHS.get(a) is family for a in architectures)):
        raise ValueError(f"{source!r} holds model_type {model_type!r} ({list(architectures)}); supported: "
                         f"{sorted(_HF_ARCHS)}.")
    return family


def family_of(config: ModelConfig) -> Family:
    """The family of a config either loader filled."""
    family = _GGUF.get(config.architecture) or _HF_TYPES.get(config.architecture)
    if family is None:
        raise ValueError(f"no model family reads architecture {config.architecture!r}; supported: "
                         f"{sorted({*_GGUF, *_HF_TYPES})}")
    return family


def build_decoder(config: ModelConfig, weights: Mapping[str, Weight], device: torch.device, dtype: torch.dtype,
                  products: Products | None = None) -> Decoder:
    """The decoder of ``config``'s family over ``weights`` (Hugging Face names)."""
    return family_of(config).decoder(config, weights, device, dtype, products)
