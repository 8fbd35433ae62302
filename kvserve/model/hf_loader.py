"""Load a Hugging Face model directory (config.json + safetensors + tokenizer.json)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from kvserve.config import ModelConfig, RopeScaling
from kvserve.model.families import hf_family
from kvserve.model.formats.packing import PackedWeight
from kvserve.model.loaded import LoadedModel, check_tokenizer
from kvserve.model.tokenizer import Tokenizer

_MIB = 1 << 20
# Tensors some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(path: Path) -> LoadedModel:
    path = path.resolve()
    raw = _read_json(path / "config.json")
    config = config_from_hf(raw, _read_json_if_present(path / "generation_config.json"), str(path))
    weight_files = _weight_files(path)
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    for file in weight_files:
        for name, tensor in load_file(file).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # saved anyway by some exporters; the embedding is the source of truth
            weights[name] = tensor.to(torch.float32).contiguous()
    eos = config.eos_token_ids[0] if config.eos_token_ids else None
    tokenizer = Tokenizer.from_hf_dir(path, fallback_eos_token_id=eos)
    check_tokenizer(tokenizer, config, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       fingerprint=fingerprint_hf_dir(path, weight_files), source=str(path))


def config_from_hf(raw: dict[str, Any], generation: dict[str, Any], source: str) -> ModelConfig:
    """``ModelConfig`` from config.json (and generation_config.json for bos/eos ids): the fields
    every family shares read here, the family's own by the family (kvserve/model/families.py)."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    family = hf_family(model_type, architectures, source)

    def need(name: str) -> Any:
        if name not in raw:
            raise ValueError(f"{source}/config.json lacks {name!r}.")
        return raw[name]

    rope = raw.get("rope_parameters") or {}
    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    eos = generation.get("eos_token_id", raw.get("eos_token_id"))
    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    common = {
        "architecture": model_type,
        "vocab_size": int(need("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(need("intermediate_size")),
        "num_layers": int(need("num_hidden_layers")),
        "num_heads": num_heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or num_heads),
        "head_dim": int(raw.get("head_dim") or hidden // num_heads),
        "rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "bos_token_id": int(bos) if bos is not None else None,
        "eos_token_ids": tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        "torch_dtype": "float32",  # the loader converts every weight to float32
        "rope_scaling": _rope_scaling(raw.get("rope_scaling") or rope, source),
    }
    return family.hf_config(raw, common, source)


def _rope_scaling(spec: dict[str, Any], source: str) -> RopeScaling | None:
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"{source!r} uses rope scaling {kind!r}; only 'llama3' is supported.")
    return RopeScaling(
        factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]))


def _weight_files(path: Path) -> list[Path]:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            raise ValueError(f"{str(index)!r} lists shards that are missing: {missing or 'none listed'}.")
        return [path / s for s in shards]
    raise ValueError(f"{str(path)!r} has neither model.safetensors nor model.safetensors.index.json "
                     "(PyTorch .bin checkpoints are not supported; convert them to safetensors).")


def fingerprint_hf_dir(path: Path, weight_files: list[Path]) -> str:
    """sha256 over config.json and, per weight file, its name, size and the sha256 of its first
    and last MiB. Hashing whole multi-GB files at every start would take minutes, so a weight
    edited only in the middle of a large shard goes unnoticed; small files are hashed whole."""
    digest = hashlib.sha256()
    digest.update((path / "config.json").read_bytes())
    for file in weight_files:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(_MIB)
            f.seek(max(size - _MIB, 0))
            tail = f.read(_MIB)
        digest.update(f"\0{file.name}\0{size}\0".encode())
        digest.update(hashlib.sha256(head).digest() + hashlib.sha256(tail).digest())
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ValueError(f"Missing file {str(path)!r}.") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):  # bad file content, not a programming error: ValueError
        raise ValueError(f"{str(path)!r} must hold a JSON object.")  # noqa: TRY004
    return data


def _read_json_if_present(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}
