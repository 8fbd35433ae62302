"""What every loader returns: ``LoadedModel``, and the checks it runs on itself.

Below both loaders (GGUF and Hugging Face) and the entry point that picks one, so none
of them imports another to share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.model.families import family_of
from kvserve.model.formats.packing import PackedWeight
from kvserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine. ``weights`` use Hugging Face names (see
    ``expected_weight_shapes``) and hold float32, CPU, contiguous tensors, or a GGUF file's
    quantized blocks (``PackedWeight``: the engine's weight format decides how they are used)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor | PackedWeight]
    tokenizer: Tokenizer
    fingerprint: str  # hex sha256 naming these weights + config; stable across processes
    source: str  # resolved path that was loaded

    def __post_init__(self) -> None:
        check_weights(self.weights, self.config, self.source)


def check_tokenizer(tokenizer: Tokenizer, config: ModelConfig, source: str) -> None:
    """Raise ValueError when the tokenizer can emit ids the embedding does not have."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"The tokenizer of {source} has {tokenizer.vocab_size} tokens but the "
                         f"model's embedding only {config.vocab_size}.")


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config``'s family must provide, with its HF shape [out, in]."""
    return family_of(config).expected_weight_shapes(config)


def check_weights(weights: dict[str, torch.Tensor | PackedWeight], config: ModelConfig, source: str) -> None:
    """Raise ValueError unless ``weights`` holds exactly the expected names and shapes, as
    contiguous float32 CPU tensors or packed blocks."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [f"{name}: {tuple(weights[name].shape)} != {shape}"
             for name, shape in expected.items()
             if name in weights and tuple(weights[name].shape) != shape]
    wrong += [f"{name}: {w.dtype} on {w.device}" for name, w in weights.items() if isinstance(w, torch.Tensor)
              and (w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous())]
    if missing or unexpected or wrong:
        raise ValueError(
            f"Weights in {source} do not match the model config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all), "
            f"wrong shape, dtype or layout {wrong[:5]}")
