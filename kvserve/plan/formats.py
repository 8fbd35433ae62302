"""KV storage formats as data: the bytes each one takes per token, layer and KV head.

THE CODEC REGISTRY MUST MATCH THIS TABLE. These are the storage layouts the engine's KV codecs
use; a codec whose layout changes changes its row here, and the planner's tests pin the numbers.

Per token, per layer, per KV head, with D = head_dim, B = block size (16), G = group size (32)
and every scale / zero-point stored as fp16 (2 bytes):

    format      K half                 V half                 K + V
    fp32        4D                     4D                     8D
    fp16/bf16   2D                     2D                     4D
    fp8 (e4m3)  D + 2 (scale/token)    D + 2                  2(D + 2)
    int8        D + 2 (symmetric)      D + 2                  2(D + 2)
    int4        D/2 + 4D/G             D/2 + 4D/G             2(D/2 + 4D/G)   scale+zero per group
    kivi4       D/2 + 4D/B             D/2 + 4D/G                             K per channel over a block
    kivi2       D/4 + 4D/B             D/4 + 4D/G                             V per token in groups

KIVI keys are quantized per channel across the B tokens of a block, so a block can only be
quantized once it is full: the open block (K and V) of every running request stays in the compute
dtype (the residual, ``HalfLayout.needs_residual``), B tokens of it per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

BLOCK_SIZE = 16          # tokens per KV block (CacheConfig.block_size default)
GROUP_SIZE = 32          # channels per quantization group (int4, KIVI values)
SCALE_NBYTES = 2         # a scale or zero-point is one fp16


@dataclass(frozen=True)
class HalfLayout:
    """Storage of the K or the V half of one layer and one KV head.

    bytes per block = B * (bits * D / 8 + token_stat_nbytes + group_stat_nbytes * ceil(D / G))
                      + channel_stat_nbytes * D
    """

    bits: int                       # stored bits per channel and token
    token_stat_nbytes: int = 0      # per token: a scale (and zero)
    group_stat_nbytes: int = 0      # per token and group of G channels: scale + zero
    channel_stat_nbytes: int = 0    # per channel and block of B tokens: scale + zero
    needs_residual: bool = False    # the open block stays in the compute dtype

    def block_nbytes(self, head_dim: int, block_size: int, group_size: int = GROUP_SIZE) -> int:
        if (self.bits * head_dim) % 8:
            raise ValueError(f"head_dim {head_dim} at {self.bits} bits is not a whole number of bytes")
        num_groups = -(-head_dim // group_size)
        per_token = self.bits * head_dim // 8 + self.token_stat_nbytes + self.group_stat_nbytes * num_groups
        return block_size * per_token + self.channel_stat_nbytes * head_dim


@dataclass(frozen=True)
class KVFormat:
    name: str
    key: HalfLayout
    value: HalfLayout
    description: str


_SCALED8 = HalfLayout(8, token_stat_nbytes=SCALE_NBYTES)
_INT4 = HalfLayout(4, group_stat_nbytes=2 * SCALE_NBYTES)


def _kivi(bits: int) -> tuple[HalfLayout, HalfLayout]:
    key = HalfLayout(bits, channel_stat_nbytes=2 * SCALE_NBYTES, needs_residual=True)
    # Values could be quantized token by token, but KIVI keeps the whole open block (K and V) in
    # the compute dtype, so both halves count the residual.
    value = HalfLayout(bits, group_stat_nbytes=2 * SCALE_NBYTES, needs_residual=True)
    return key, value


FORMATS: MappingProxyType[str, KVFormat] = MappingProxyType({f.name: f for f in (
    KVFormat("fp32", HalfLayout(32), HalfLayout(32), "float32"),
    KVFormat("fp16", HalfLayout(16), HalfLayout(16), "float16"),
    KVFormat("bf16", HalfLayout(16), HalfLayout(16), "bfloat16"),
    KVFormat("fp8", _SCALED8, _SCALED8, "float8 e4m3, one fp16 scale per token and head"),
    KVFormat("int8", _SCALED8, _SCALED8, "int8 symmetric per token and head, fp16 scale"),
    KVFormat("int4", _INT4, _INT4,
             f"int4 asymmetric, fp16 scale + zero per {GROUP_SIZE} channels of a token"),
    KVFormat("kivi4", *_kivi(4), f"KIVI 4-bit: K per channel over a block, V per token in groups of "
             f"{GROUP_SIZE}; open block in the compute dtype"),
    KVFormat("kivi2", *_kivi(2), f"KIVI 2-bit: K per channel over a block, V per token in groups of "
             f"{GROUP_SIZE}; open block in the compute dtype"),
)})

# Formats a residual (KIVI's open block) may be kept in: the compute dtypes.
COMPUTE_FORMATS = ("fp16", "bf16", "fp32")


def get_format(name: str) -> KVFormat:
    """The format named ``name`` (case-insensitive); ValueError listing the choices otherwise."""
    fmt = FORMATS.get(name.strip().lower())
    if fmt is None:
        raise ValueError(f"unknown KV format {name!r}; choose one of {', '.join(FORMATS)}")
    return fmt
