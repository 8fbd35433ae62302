"""KV formats as the planner counts them: every byte count comes from the engine's own codecs
(kvserve/kv/codecs), so the planner and the cache can never disagree.

A layout is any spec the engine takes (``int8``, ``kivi2+had``, ``k=int8,v=int4``,
``0-1=fp16;2-=kivi2``), or one codec token per layer; ``FORMATS`` names the formats that
``kvserve plan --list-formats`` prints, with a line on how each stores a block.

Per token, per layer, per KV head, with D = head_dim, B = block size, G = group size and
every scale / zero-point stored as fp16 (what the codecs' parts add up to):

    format      K half                 V half
    fp32        4D                     4D
    fp16/bf16   2D                     2D
    fp8, int8   D + 2 (scale/token)    D + 2
    int4        D/2 + 4D/G             D/2 + 4D/G
    kivi4       D/2 + 4D/B             D/2 + 4D/G      K per channel over a block
    kivi2       D/4 + 4D/B             D/4 + 4D/G      V per token in groups
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kvserve.config import CacheConfig
from kvserve.kv.codecs import DEFAULT_GROUP_SIZE, HalfCodec, KVFormat, LayerFormat, parse_codec, parse_kv_format

BLOCK_SIZE = CacheConfig().block_size      # tokens per KV block, the engine's default
GROUP_SIZE = DEFAULT_GROUP_SIZE            # channels per quantization group (int4, KIVI values)

# The dtype KIVI's residual (the open block) is kept in: the compute dtypes.
COMPUTE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32})
COMPUTE_FORMATS = tuple(COMPUTE_DTYPES)

LayerSpec = str | tuple[str, str]          # a codec token, or (key token, value token)
FormatSpec = str | tuple[LayerSpec, ...] | list[LayerSpec]   # an engine spec, or one per layer


@dataclass(frozen=True)
class HalfSize:
    """The K or the V half of a named format at one KV head, sized by its codec."""

    codec: HalfCodec

    def block_nbytes(self, head_dim: int, block_size: int) -> int:
        return self.codec.nbytes_per_block(block_size, 1, head_dim)


@dataclass(frozen=True)
class NamedFormat:
    """A row of ``kvserve plan --list-formats``."""

    name: str
    key: HalfSize
    value: HalfSize
    description: str


_DESCRIPTIONS = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8 e4m3, one fp16 scale per token and head",
    "int8": "int8 symmetric per token and head, fp16 scale",
    "int4": f"int4 asymmetric, fp16 scale + zero per {GROUP_SIZE} channels of a token",
    "kivi4": f"KIVI 4-bit: K per channel over a block, V per token in groups of {GROUP_SIZE}; "
             "open block in the compute dtype",
    "kivi2": f"KIVI 2-bit: K per channel over a block, V per token in groups of {GROUP_SIZE}; "
             "open block in the compute dtype",
}


def _named(name: str) -> NamedFormat:
    dtype = COMPUTE_DTYPES["fp16"]
    return NamedFormat(name, HalfSize(parse_codec(name, "k", dtype)), HalfSize(parse_codec(name, "v", dtype)),
                       _DESCRIPTIONS[name])


FORMATS: Mapping[str, NamedFormat] = MappingProxyType({name: _named(name) for name in _DESCRIPTIONS})


def get_format(name: str) -> NamedFormat:
    """The listed format named ``name`` (case-insensitive); ValueError listing the choices otherwise."""
    fmt = FORMATS.get(name.strip().lower())
    if fmt is None:
        raise ValueError(f"unknown KV format {name!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def compute_dtype(name: str) -> torch.dtype:
    dtype = COMPUTE_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"compute dtype must be one of {COMPUTE_FORMATS}, got {name!r}")
    return dtype


def build_format(num_layers: int, head_dim: int, kv_format: FormatSpec, dtype: torch.dtype,
                 key_format: str | None = None, value_format: str | None = None) -> KVFormat:
    """The engine's KVFormat for a spec string, or for one codec token (or (K, V) pair) per layer.

    ``key_format`` / ``value_format`` override the K or V half of every layer (AsymKV-style:
    the K half takes its format's key codec, the V half its format's value codec)."""
    if isinstance(kv_format, str) and key_format is None and value_format is None:
        return parse_kv_format(kv_format, num_layers, dtype, head_dim=head_dim)
    if isinstance(kv_format, str):
        base = parse_kv_format(kv_format, num_layers, dtype, head_dim=head_dim).layers
        layers = [LayerFormat(parse_codec(key_format, "k", dtype) if key_format else layer.key,
                              parse_codec(value_format, "v", dtype) if value_format else layer.value)
                  for layer in base]
    else:
        if len(kv_format) != num_layers:
            raise ValueError(f"{len(kv_format)} per-layer KV formats given for a model of {num_layers} layers")
        layers = []
        for spec in kv_format:
            key_name, value_name = (spec, spec) if isinstance(spec, str) else spec
            layers.append(LayerFormat(parse_codec(key_format or key_name, "k", dtype),
                                      parse_codec(value_format or value_name, "v", dtype)))
    text = ";".join(f"{i}=k={layer.key.name},v={layer.value.name}" for i, layer in enumerate(layers))
    return parse_kv_format(text, num_layers, dtype, head_dim=head_dim)


def display_name(fmt: KVFormat) -> str:
    """The format as a report names it: ``kivi4``, ``k:int8,v:int4``, or ``per-layer``
    (the canonical spec without default group sizes)."""
    if ";" in fmt.spec:
        return "per-layer"
    name = re.sub(rf"g{GROUP_SIZE}(?=[+,]|$)", "", fmt.spec)
    m = re.fullmatch(r"k=(.*),v=(.*)", name)
    return f"k:{m.group(1)},v:{m.group(2)}" if m else name
