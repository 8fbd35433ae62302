"""Load a llama.cpp GGUF file: rename to HF names, keep the quantized blocks kernels read, cache.

Matrices in a type the kernels read in place (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
stay the file's own blocks, moved into the kernels' layout (kvserve/model/formats/packing.py:
the same bits, so a ``native`` engine dequantizes them to exactly what
``gguf.quants.dequantize`` gives); other types (Q2_K, Q3_K, the IQ types) are dequantized to
float32 here, one log line naming them. Opening a GGUF takes seconds, so the converted weights
are kept as safetensors in the cache dir, next to a JSON file with config, fingerprint,
tokenizer and the packed weights' layout. The JSON is written last and names the weights
file's size, so it doubles as the commit marker of an entry.

    <cache_dir>/gguf/<key>.safetensors   HF-named weights: float32, or packed planes (name#0.codes, ...)
    <cache_dir>/gguf/<key>.json          {"loader_version", "source", "fingerprint", "config", "packed", ...}
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvserve.config import ModelConfig
from kvserve.model.families import gguf_family
from kvserve.model.family import Family, GGUFKeys
from kvserve.model.formats.packing import GGUF_TYPES, PackedWeight, flatten, pack_gguf, unflatten
from kvserve.model.gguf_tokenizer import tokenizer_fields
from kvserve.model.llama import LLAMA
from kvserve.model.loaded import LoadedModel, check_tokenizer
from kvserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bump whenever conversion output changes, so stale cache entries are ignored.
LOADER_VERSION = 4

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, family: Family = LLAMA) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (the family's names)."""
    if m := _LAYER_RE.match(gguf_name):
        layer, leaf, kind = m.groups()
        if leaf in family.gguf_layer_names:
            return f"model.layers.{layer}.{family.gguf_layer_names[leaf]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no {family.name}-family equivalent; this file's "
                     "architecture variant is not supported.")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row order (interleaved -> HF's rotate-half halves).

    convert did ``w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)``.
    Works for biases (1-D) too.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def cache_paths(path: Path, cache_dir: Path) -> tuple[Path, Path]:
    """(weights, metadata) cache files for the GGUF at ``path`` as it is now on disk."""
    stat = path.stat()
    key = f"{LOADER_VERSION}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    folder = cache_dir / "gguf"
    return folder / f"{path.stem}-{digest}.safetensors", folder / f"{path.stem}-{digest}.json"


def load_gguf(path: Path, cache_dir: Path) -> LoadedModel:
    """Load the GGUF at ``path``, from ``cache_dir`` when a valid entry exists.

    A missing, stale, unreadable or corrupt cache entry is rebuilt, never an error; a cache dir
    that cannot be written only costs the speed-up.
    """
    path = path.resolve()
    weights_file, meta_file = cache_paths(path, cache_dir)
    cached = _read_cache(weights_file, meta_file, str(path))
    if cached is not None:
        return cached
    loaded = convert_gguf(path)
    try:
        _write_cache(loaded, weights_file, meta_file)
    except OSError:
        pass  # read-only or full cache dir: serve the converted model uncached
    return loaded


def convert_gguf(path: Path) -> LoadedModel:
    """Read and dequantize the whole file (seconds). Raises ValueError for unsupported files."""
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad input
        raise ValueError(f"Cannot read GGUF file {str(path)!r}: {e}") from e
    family, config = _config_from_metadata(reader, str(path))
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    dequantized: dict[str, int] = {}
    for t in reader.tensors:
        name = hf_name(t.name, family)
        shape = [int(d) for d in reversed(t.shape)]   # GGUF lists dims innermost first
        order = _row_order(family, config, name, shape[0])
        type_name = t.tensor_type.name
        if type_name in GGUF_TYPES and len(shape) == 2:
            weights[name] = pack_gguf(type_name, np.asarray(t.data).reshape(-1).view(np.uint8), shape[0], shape[1],
                                      order)
            continue
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if order is not None:
            array = array[order]
        if family.gguf_norm_shift and name.endswith("norm.weight"):
            array = array + np.float32(family.gguf_norm_shift)     # back to the Hugging Face weight
        if type_name not in ("F32", "F16", "BF16"):
            dequantized[type_name] = dequantized.get(type_name, 0) + 1
        # F32 tensors are read-only views of the file's memmap: copy those, not fresh dequant output
        weights[name] = torch.from_numpy(np.require(array, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
    if dequantized:
        log.info("%s: %s tensors are dequantized to float32 (no kernel reads those types in place)", path.name,
                 ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items())))
    fields = tokenizer_fields(reader)
    if fields.chat_template is None and family.chat_template is not None:    # the file carries none
        fields = dataclasses.replace(fields, chat_template=family.chat_template)
    tokenizer = Tokenizer.from_gguf_fields(fields)
    check_tokenizer(tokenizer, config, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       fingerprint=file_sha256(path), source=str(path))


def _row_order(family: Family, config: ModelConfig, name: str, rows: int) -> np.ndarray | None:
    """The permutation that undoes llama.cpp's convert-time Q/K row order, for those matrices."""
    if not family.permutes_qk_rows(config.architecture):
        return None
    if ".self_attn.q_proj." in name:
        return unpermute_rows(np.arange(rows), config.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_rows(np.arange(rows), config.num_kv_heads)
    return None


def _field(reader: gguf.GGUFReader, name: str) -> Any:
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _config_from_metadata(reader: gguf.GGUFReader, source: str) -> tuple[Family, ModelConfig]:
    """The file's family and config: the fields every family shares read here, the family's own
    by the family."""
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch, source)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # innermost dim first
    fields = {name: f.contents() for name, f in reader.fields.items()
              if name.startswith((f"{arch}.", "tokenizer.ggml.bos", "tokenizer.ggml.eo"))}
    fields["tokenizer.ggml.tokens"] = _field(reader, "tokenizer.ggml.tokens")
    keys = GGUFKeys(fields, arch, source, shapes)
    num_heads = int(keys.arch("attention.head_count"))
    hidden = int(keys.arch("embedding_length"))
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {source!r} has no token_embd.weight tensor.")
    bos = keys.get("tokenizer.ggml.bos_token_id")
    eos_ids = [keys.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    common = {
        "architecture": arch,
        "vocab_size": shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "intermediate_size": int(keys.arch("feed_forward_length")),
        "num_layers": int(keys.arch("block_count")),
        "num_heads": num_heads,
        "num_kv_heads": int(keys.arch("attention.head_count_kv", num_heads)),
        "head_dim": int(keys.arch("attention.key_length", keys.arch("rope.dimension_count", hidden // num_heads))),
        "rope_theta": float(keys.arch("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(keys.arch("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(keys.arch("context_length")),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_ids": tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        "torch_dtype": "float32",
    }
    return family, family.gguf_config(keys, common)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _read_cache(weights_file: Path, meta_file: Path, source: str) -> LoadedModel | None:
    """The cached model, or None when the entry is missing, stale or damaged in any way."""
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        if meta["loader_version"] != LOADER_VERSION or meta["source"] != source:
            return None
        if weights_file.stat().st_size != meta["weights_nbytes"]:
            return None
        # LoadedModel checks names, shapes and dtypes; a mismatch raises and means rebuild.
        tensors = load_file(weights_file)
        weights: dict[str, torch.Tensor | PackedWeight] = {
            name: unflatten(name, tensors, layout) for name, layout in meta["packed"].items()}
        weights |= {name: t for name, t in tensors.items() if "#" not in name}
        return LoadedModel(config=ModelConfig.from_dict(meta["config"]), weights=weights,
                           tokenizer=Tokenizer.from_json(meta["tokenizer"]),
                           fingerprint=meta["fingerprint"], source=source)
    except Exception:  # noqa: BLE001  any damage (truncation, garbage, missing keys): rebuild
        return None


def _write_cache(loaded: LoadedModel, weights_file: Path, meta_file: Path) -> None:
    weights_file.parent.mkdir(parents=True, exist_ok=True)
    meta_file.unlink(missing_ok=True)  # invalidate the entry before replacing its weights
    tensors: dict[str, torch.Tensor] = {}
    packed: dict[str, list[dict[str, object]]] = {}
    for name, w in loaded.weights.items():
        if isinstance(w, PackedWeight):
            planes, packed[name] = flatten(name, w)
            tensors |= planes
        else:
            tensors[name] = w
    _atomic_write(weights_file, lambda tmp: save_file(tensors, tmp))
    meta = {"loader_version": LOADER_VERSION, "source": loaded.source, "packed": packed,
            "fingerprint": loaded.fingerprint, "weights_nbytes": weights_file.stat().st_size,
            "config": loaded.config.to_dict(), "tokenizer": loaded.tokenizer.to_json()}
    _atomic_write(meta_file, lambda tmp: Path(tmp).write_text(json.dumps(meta), encoding="utf-8"))


def _atomic_write(target: Path, write: Any) -> None:
    """Write via a temp file in the same folder, then ``os.replace``: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
