"""KV format spec strings: which codec stores the keys and the values of each layer.

    spec    := "auto" | segment (";" segment)*
    segment := [layers "="] halves          layers: "3", "0-3", or "4-" (to the last layer)
    halves  := codec | "k=" codec "," "v=" codec
    codec   := NAME ["g" GROUP] ("+out" N | "+had")*

``auto`` (the engine's default) stores keys and values in 16 bits: ``native`` where the compute
dtype is a 16-bit one (CUDA's bfloat16 / float16), ``fp16`` over float32 compute (the CPU's): half
of float32's bytes, perplexity within 0.1% of it and 1.3-1.4x faster decoding at 4,000 tokens on
the CPU kernel, measured in docs/kv_formats.md (llama.cpp stores f16 by default too).

A segment without layers covers every layer and must be the only one; otherwise the
ranges must cover every layer exactly once. Case and whitespace are ignored. The
canonical string (``KVFormat.spec``) depends only on what is stored, so it can be
part of every block's content key: ``native`` becomes the compute dtype's name,
default group sizes are written out, options are ordered ``+had`` then ``+outN``,
halves are merged when one codec name builds both, equal neighbouring layers merge
into ranges ``a-b``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from kvserve.kv.codecs.base import HalfCodec
from kvserve.kv.codecs.plain import PlainCodec
from kvserve.kv.codecs.registry import KV_FORMATS, CodecArgs, Half
from kvserve.kv.codecs.transforms import HadamardCodec, OutlierCodec

_LAYERS = re.compile(r"(\d+)(-(\d*))?")
_CODEC = re.compile(r"([a-z]+\d*)(?:g(\d+))?")
_OUT = re.compile(r"out(\d+)")
_SYNTAX = "NAME[gGROUP][+outN][+had], e.g. int4g64+had"


@dataclass(frozen=True)
class LayerFormat:
    key: HalfCodec
    value: HalfCodec


DEFAULT_SALIENT = 0.2
ZIP_RANKS = ("saliency", "recent")


@dataclass(frozen=True)
class Refinement:
    """Precision by saliency (``zip:``): besides its base encoding (``KVFormat.layers``), a
    block may hold a second, finer encoding (``layers``) in a side pool sized for ``salient``
    of the blocks; reads take the finer one where a block has it (kv/storage/zip.py)."""

    layers: tuple[LayerFormat, ...]
    salient: float
    rank: str = "saliency"     # which blocks keep it: the most salient, or ("recent") the first and newest

    def __post_init__(self) -> None:
        if not 0 < self.salient < 1:
            raise ValueError(f"salient must be a fraction of the blocks in (0, 1), got {self.salient}")
        if self.rank not in ZIP_RANKS:
            raise ValueError(f"rank={self.rank!r}: choose one of {', '.join(ZIP_RANKS)}")


@dataclass(frozen=True)
class KVFormat:
    spec: str                        # canonical spec string; part of every block's content key
    layers: tuple[LayerFormat, ...]  # one per layer (under ``refine``: every block's base encoding)
    compute_dtype: torch.dtype
    refine: Refinement | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a KV format needs at least one layer")
        if self.refine is not None and len(self.refine.layers) != len(self.layers):
            raise ValueError("a refinement needs a format for every layer")

    @property
    def is_lossless(self) -> bool:
        """True only for native storage: every half plain, in the compute dtype."""
        return self.refine is None and all(isinstance(c, PlainCodec) and c.dtype == self.compute_dtype
                   for layer in self.layers for c in (layer.key, layer.value))

    def keeps_rows(self, codec: HalfCodec) -> bool:
        """Whether a half of this format keeps its open blocks in full-precision residual rows:
        a codec that encodes whole blocks, and under ``refine`` every half (a block is encoded
        into both formats once, when it is full)."""
        return self.refine is not None or codec.encodes_whole_blocks

    def nbytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Exact bytes of one block across all layers, keys and values; under ``refine``, the base
        encoding plus ``salient`` of the finer one (rounded up): what a block costs on average."""
        base = _layers_nbytes(self.layers, block_size, num_kv_heads, head_dim)
        if self.refine is None:
            return base
        return base + math.ceil(self.refine.salient * self.refined_nbytes_per_block(block_size, num_kv_heads, head_dim))

    def refined_nbytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block's finer encoding (0 without ``refine``)."""
        if self.refine is None:
            return 0
        return _layers_nbytes(self.refine.layers, block_size, num_kv_heads, head_dim)

    def bytes_per_token(self, block_size: int, num_kv_heads: int, head_dim: int) -> float:
        return self.nbytes_per_block(block_size, num_kv_heads, head_dim) / block_size


def _layers_nbytes(layers: tuple[LayerFormat, ...], block_size: int, num_kv_heads: int, head_dim: int) -> int:
    return sum(c.nbytes_per_block(block_size, num_kv_heads, head_dim) for layer in layers for c in (layer.key, layer.value))


def parse_codec(token: str, half: Half, compute_dtype: torch.dtype) -> HalfCodec:
    """One half's codec from a token such as ``int4g64+had+out4``."""
    head, *options = token.split("+")
    m = _CODEC.fullmatch(head)
    if m is None:
        raise ValueError(f"bad KV codec {token!r}: expected {_SYNTAX}")
    name, group = m.group(1), m.group(2)
    if name not in KV_FORMATS:
        raise ValueError(f"unknown KV format {name!r} in {token!r}; known: {', '.join(KV_FORMATS)}")
    codec = KV_FORMATS[name](CodecArgs(half, compute_dtype, int(group) if group else None))
    had, outliers = False, 0
    for opt in options:
        out = _OUT.fullmatch(opt)
        if opt == "had" and not had:
            had = True
        elif out is not None and not outliers:
            outliers = int(out.group(1))
            if outliers < 1:
                raise ValueError(f"{token!r}: +out needs at least one channel")
        else:
            raise ValueError(f"bad option {'+' + opt!r} in {token!r}: options are +outN and +had, each at most once")
    if (had or outliers) and isinstance(codec, PlainCodec):
        raise ValueError(f"{token!r}: +had and +outN apply to quantized formats, not to {codec.name}")
    if had:
        codec = HadamardCodec(codec)
    if outliers:
        codec = OutlierCodec(codec, outliers)
    return codec


AUTO = "auto"


def auto_kv_format(compute_dtype: torch.dtype) -> str:
    """What ``auto`` stores under ``compute_dtype`` (the module docstring): 16-bit keys and values."""
    return "fp16" if compute_dtype == torch.float32 else "native"


def parse_kv_format(spec: str, num_layers: int, compute_dtype: torch.dtype, *,
                    head_dim: int | None = None) -> KVFormat:
    """Parse a spec into a KVFormat with a canonical spec string (ValueError on a bad spec).

    With ``head_dim`` the codecs are also checked against the head shape (group sizes
    dividing it, +had needing a power of two); without it that check happens when
    the cache asks for the parts.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    text = re.sub(r"\s+", "", spec).lower()
    if text == AUTO:
        text = auto_kv_format(compute_dtype)
    if text.startswith("zip:"):
        return _parse_zip(text[4:], num_layers, compute_dtype, head_dim)
    if not text:
        raise ValueError("empty KV format spec; try 'native', 'int8', 'kivi2' or 'k=int8,v=int4'")
    owners: list[str | None] = [None] * num_layers
    layers: list[LayerFormat | None] = [None] * num_layers
    segments = text.split(";")
    if not all(segments):
        raise ValueError(f"empty segment in KV format spec {spec!r} (a stray ';'?)")
    for segment in segments:
        first, last, halves = _split_segment(segment, num_layers, len(segments))
        layer = _parse_halves(halves, compute_dtype)
        for i in range(first, last + 1):
            if owners[i] is not None:
                raise ValueError(f"layer {i} is given twice in {spec!r}: by {owners[i]!r} and by {segment!r}")
            owners[i], layers[i] = segment, layer
    missing = [i for i, layer in enumerate(layers) if layer is None]
    if missing:
        raise ValueError(f"{spec!r} gives no format for layers {_ranges_text(missing)} "
                         f"(the model has layers 0-{num_layers - 1}; '4-' reaches the last)")
    full = tuple(layer for layer in layers if layer is not None)
    if head_dim is not None:
        for layer in full:
            layer.key.check_head_dim(head_dim)
            layer.value.check_head_dim(head_dim)
    return KVFormat(_canonical(full, compute_dtype), full, compute_dtype)


_ZIP_KEY = re.compile(r",(?=(?:hi|lo|salient|rank)=)")
ZIP_SYNTAX = "zip:hi=SPEC,lo=SPEC[,salient=FRACTION][,rank=saliency|recent], e.g. zip:hi=int8,lo=kivi2,salient=0.2"


def _parse_zip(text: str, num_layers: int, compute_dtype: torch.dtype, head_dim: int | None) -> KVFormat:
    """``hi=...,lo=...,salient=...`` (any order; hi and lo are plain specs, not zip)."""
    given: dict[str, str] = {}
    for item in _ZIP_KEY.split(text):
        key, eq, value = item.partition("=")
        if key not in ("hi", "lo", "salient", "rank") or not eq or not value or key in given:
            raise ValueError(f"bad zip format 'zip:{text}': expected {ZIP_SYNTAX}")
        given[key] = value
    if "hi" not in given or "lo" not in given:
        raise ValueError(f"'zip:{text}' needs both hi= and lo= ({ZIP_SYNTAX})")
    if given["hi"].startswith("zip:") or given["lo"].startswith("zip:"):
        raise ValueError("zip formats do not nest")
    try:
        salient = float(given.get("salient", DEFAULT_SALIENT))
    except ValueError:
        raise ValueError(f"salient={given['salient']!r} is not a number ({ZIP_SYNTAX})") from None
    hi = parse_kv_format(given["hi"], num_layers, compute_dtype, head_dim=head_dim)
    lo = parse_kv_format(given["lo"], num_layers, compute_dtype, head_dim=head_dim)
    refine = Refinement(hi.layers, salient, given.get("rank", "saliency"))
    rank = "" if refine.rank == "saliency" else f",rank={refine.rank}"
    return KVFormat(f"zip:hi={hi.spec},lo={lo.spec},salient={salient:g}{rank}", lo.layers, compute_dtype, refine)


def _split_segment(segment: str, num_layers: int, num_segments: int) -> tuple[int, int, str]:
    """(first layer, last layer, halves text) of one segment."""
    prefix, eq, rest = segment.partition("=")
    m = _LAYERS.fullmatch(prefix) if eq else None
    if m is None:
        if num_segments > 1:
            raise ValueError(f"segment {segment!r} names no layers; with several segments each needs "
                             f"'a-b=', 'a=' or 'a-=' in front")
        return 0, num_layers - 1, segment
    first = int(m.group(1))
    last = first if m.group(2) is None else (int(m.group(3)) if m.group(3) else num_layers - 1)
    if first > last:
        raise ValueError(f"layer range {prefix!r} is empty (first > last)")
    if last >= num_layers:
        raise ValueError(f"layer range {prefix!r} is beyond the model's layers 0-{num_layers - 1}")
    return first, last, rest


def _parse_halves(text: str, compute_dtype: torch.dtype) -> LayerFormat:
    if not text.startswith(("k=", "v=")):
        return LayerFormat(parse_codec(text, "k", compute_dtype), parse_codec(text, "v", compute_dtype))
    given: dict[str, str] = {}
    for item in text.split(","):
        half, eq, token = item.partition("=")
        if half not in ("k", "v") or not eq or half in given:
            raise ValueError(f"bad halves {text!r}: write 'k=CODEC,v=CODEC' (each once) or one CODEC for both")
        given[half] = token
    if len(given) != 2:
        raise ValueError(f"{text!r} gives only {', '.join(given)}=; give both k= and v=")
    return LayerFormat(parse_codec(given["k"], "k", compute_dtype), parse_codec(given["v"], "v", compute_dtype))


def _layer_text(layer: LayerFormat, compute_dtype: torch.dtype) -> str:
    """One token for both halves when one builds exactly these two codecs, else k=..,v=..."""
    k, v = layer.key.name, layer.value.name
    candidates = [v, k]
    m = re.fullmatch(r"int(\d)(g\d+)(.*)", v)   # KIVI: per-channel keys, per-token values
    if m is not None:
        candidates.insert(0, f"kivi{m.group(1)}{m.group(2)}{m.group(3)}")
    for token in candidates:
        try:
            pair = (parse_codec(token, "k", compute_dtype).name, parse_codec(token, "v", compute_dtype).name)
        except ValueError:
            continue
        if pair == (k, v):
            return token
    return f"k={k},v={v}"


def _canonical(layers: tuple[LayerFormat, ...], compute_dtype: torch.dtype) -> str:
    texts = [_layer_text(layer, compute_dtype) for layer in layers]
    if len(set(texts)) == 1:
        return texts[0]
    runs: list[tuple[int, int, str]] = []
    for i, text in enumerate(texts):
        if runs and runs[-1][2] == text:
            runs[-1] = (runs[-1][0], i, text)
        else:
            runs.append((i, i, text))
    return ";".join(f"{a}={t}" if a == b else f"{a}-{b}={t}" for a, b, t in runs)


def _ranges_text(ids: list[int]) -> str:
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
