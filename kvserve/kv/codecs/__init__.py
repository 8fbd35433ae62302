"""KV block codecs: how the keys and values of full blocks are stored (issue 3).

``parse_kv_format("kivi2", num_layers, compute_dtype)`` gives a ``KVFormat``: one
``LayerFormat`` (a key codec and a value codec) per layer and a canonical spec
string. Formats, byte counts and measured errors: docs/kv_formats.md.
"""

from kvserve.kv.codecs.asymmetric import AsymQuantCodec
from kvserve.kv.codecs.base import HalfCodec, PartSpec
from kvserve.kv.codecs.plain import PlainCodec
from kvserve.kv.codecs.registry import DEFAULT_GROUP_SIZE, KV_FORMATS, CodecArgs, CodecFactory
from kvserve.kv.codecs.spec import KVFormat, LayerFormat, Refinement, parse_codec, parse_kv_format
from kvserve.kv.codecs.symmetric import Fp8Codec, Int8Codec, fp8_supported
from kvserve.kv.codecs.transforms import HadamardCodec, OutlierCodec, hadamard_rotate

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "KV_FORMATS",
    "AsymQuantCodec",
    "CodecArgs",
    "CodecFactory",
    "Fp8Codec",
    "HadamardCodec",
    "HalfCodec",
    "Int8Codec",
    "KVFormat",
    "LayerFormat",
    "OutlierCodec",
    "PartSpec",
    "PlainCodec",
    "Refinement",
    "fp8_supported",
    "hadamard_rotate",
    "parse_codec",
    "parse_kv_format",
]
