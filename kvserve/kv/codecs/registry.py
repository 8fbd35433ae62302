"""The KV formats users can name, each a factory of the codec for one half (K or V).

A factory gets the half (KIVI quantizes keys and values differently), the compute
dtype (``native``) and the group size written in the spec (``int4g64``), and raises
ValueError for arguments that make no sense for its format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

from kvserve.kv.codecs.asymmetric import AsymQuantCodec
from kvserve.kv.codecs.base import HalfCodec
from kvserve.kv.codecs.plain import PLAIN_DTYPES, PlainCodec
from kvserve.kv.codecs.symmetric import Fp8Codec, Int8Codec

Half = Literal["k", "v"]
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class CodecArgs:
    half: Half
    compute_dtype: torch.dtype
    group_size: int | None = None  # `g<N>` from the spec; None: none was written

    def __post_init__(self) -> None:
        if self.half not in ("k", "v"):
            raise ValueError(f"half must be 'k' or 'v', got {self.half!r}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group size must be positive, got g{self.group_size}")


CodecFactory = Callable[[CodecArgs], HalfCodec]


def _no_group(name: str, args: CodecArgs) -> None:
    if args.group_size is not None:
        raise ValueError(f"{name} takes no group size (got {name}g{args.group_size}); "
                         f"group sizes apply to int4, int2, kivi2 and kivi4")


def _plain(name: str, dtype: torch.dtype | None) -> CodecFactory:
    def make(args: CodecArgs) -> HalfCodec:
        _no_group(name, args)
        storage = args.compute_dtype if dtype is None else dtype
        if storage not in PLAIN_DTYPES:
            raise ValueError(f"native KV storage: compute dtype {storage} is not one of fp32, fp16, bf16")
        return PlainCodec(storage)
    return make


def _int8(args: CodecArgs) -> HalfCodec:
    _no_group("int8", args)
    return Int8Codec()


def _fp8(args: CodecArgs) -> HalfCodec:
    _no_group("fp8", args)
    return Fp8Codec()


def _grouped(bits: int) -> CodecFactory:
    def make(args: CodecArgs) -> HalfCodec:
        return AsymQuantCodec(bits, "token", args.group_size or DEFAULT_GROUP_SIZE)
    return make


def _kivi(bits: int) -> CodecFactory:
    # Keys per channel across the block's tokens (the group size is the values' only),
    # values per token in groups of channels.
    def make(args: CodecArgs) -> HalfCodec:
        if args.half == "k":
            return AsymQuantCodec(bits, "channel")
        return AsymQuantCodec(bits, "token", args.group_size or DEFAULT_GROUP_SIZE)
    return make


KV_FORMATS: Mapping[str, CodecFactory] = MappingProxyType({
    "native": _plain("native", None),
    "fp32": _plain("fp32", torch.float32),
    "fp16": _plain("fp16", torch.float16),
    "bf16": _plain("bf16", torch.bfloat16),
    "fp8": _fp8,
    "int8": _int8,
    "int4": _grouped(4),
    "int2": _grouped(2),
    "kivi4": _kivi(4),
    "kivi2": _kivi(2),
})
