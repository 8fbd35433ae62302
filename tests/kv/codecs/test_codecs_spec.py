"""KV format spec strings: canonical forms, errors, bytes per token of SmolLM2."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.codecs import KV_FORMATS, AsymQuantCodec, OutlierCodec, PlainCodec, fp8_supported, parse_kv_format

L, H, D, B = 30, 3, 64, 16   # SmolLM2-135M
F32 = torch.float32


def canonical(spec: str, dtype: torch.dtype = F32) -> str:
    return parse_kv_format(spec, L, dtype, head_dim=D).spec


@pytest.mark.parametrize(("spec", "expected"), [
    ("native", "fp32"),
    ("fp32", "fp32"),
    (" Int8 ", "int8"),
    ("int4", "int4g32"),
    ("int4g32", "int4g32"),
    ("int4g64", "int4g64"),
    ("kivi2", "kivi2g32"),
    ("k=kivi2,v=int2", "kivi2g32"),
    ("k=kivi2g64,v=int2g32", "kivi2g32"),           # kivi keys have no group
    ("kivi2g64", "kivi2g64"),
    ("k=kivi2,v=int2g64", "kivi2g64"),
    ("k=int8,v=int4", "k=int8,v=int4g32"),
    ("v=int4, k=int8", "k=int8,v=int4g32"),
    ("k=int8,v=int8", "int8"),
    ("int8+out4+had", "int8+had+out4"),
    ("int8+had+out4", "int8+had+out4"),
    ("kivi2+out4", "kivi2g32+out4"),
    ("k=kivi2+out4,v=kivi2", "k=kivi2+out4,v=int2g32"),
    ("0-29=int8", "int8"),
    ("0-14=int8;15-=int8", "int8"),
    ("0-1=fp16;2-=kivi2", "0-1=fp16;2-29=kivi2g32"),
    ("0-3=k=int8,v=int8;4-=kivi2+had", "0-3=int8;4-29=kivi2g32+had"),
    ("5=fp16;0-4=int8;6-=int8", "0-4=int8;5=fp16;6-29=int8"),
    ("29=fp16;0-28=native", "0-28=fp32;29=fp16"),
])
def test_canonical_forms(spec, expected):
    assert canonical(spec) == expected
    assert canonical(expected) == expected                 # canonical strings are fixed points


def test_auto_is_16_bit_kv_fp16_over_float32_and_native_over_16_bit_compute():
    assert canonical("auto") == canonical(" AUTO ") == "fp16"
    assert canonical("auto", torch.bfloat16) == "bf16" and canonical("auto", torch.float16) == "fp16"
    assert parse_kv_format("auto", L, torch.bfloat16).is_lossless
    assert not parse_kv_format("auto", L, F32).is_lossless
    with pytest.raises(ValueError):
        canonical("0-1=auto;2-=int8")          # auto names a whole format, not a layer's codec


def test_native_is_the_compute_dtype_and_only_it_is_lossless():
    assert canonical("native", torch.float16) == "fp16"
    assert canonical("native", torch.bfloat16) == "bf16"
    assert parse_kv_format("native", L, F32).is_lossless
    assert parse_kv_format("fp32", L, F32).is_lossless
    assert parse_kv_format("fp16", L, torch.float16).is_lossless
    assert not parse_kv_format("fp16", L, F32).is_lossless
    assert not parse_kv_format("fp32", L, torch.float16).is_lossless   # not the native layout
    assert not parse_kv_format("int8", L, F32).is_lossless
    assert not parse_kv_format("0-28=native;29=int8", L, F32).is_lossless


def test_different_meanings_give_different_strings():
    specs = ["fp32", "fp16", "bf16", "int8", "int4", "int4g64", "int2", "kivi2", "kivi4", "kivi2g64",
             "int8+had", "int8+out4", "int8+out2", "int8+had+out4", "k=int8,v=int4", "k=int4,v=int8",
             "k=kivi2,v=int4", "0-1=fp16;2-=kivi2", "0-2=fp16;3-=kivi2", "0-1=fp16;2-=kivi4"]
    if fp8_supported():
        specs.append("fp8")
    assert len({canonical(s) for s in specs}) == len(specs)


def test_layers_get_their_codecs():
    fmt = parse_kv_format("0-3=k=int8,v=int4;4-=kivi2+out4", L, F32, head_dim=D)
    assert len(fmt.layers) == L
    assert fmt.layers[3].key.name == "int8" and fmt.layers[3].value == AsymQuantCodec(4, "token", 32)
    assert fmt.layers[4].key == OutlierCodec(AsymQuantCodec(2, "channel"), 4)
    assert fmt.layers[29].value.name == "int2g32+out4"
    assert parse_kv_format("native", L, torch.bfloat16).layers[0].key == PlainCodec(torch.bfloat16)


@pytest.mark.parametrize(("spec", "message"), [
    ("", "empty"),
    ("int9", "unknown KV format 'int9'"),
    ("kivi3", "unknown KV format"),
    ("int4g", "bad KV codec"),
    ("int4g0", "group size must be positive"),
    ("int4g48", "group size 48 does not divide head_dim 64"),
    ("int8g32", "int8 takes no group size"),
    ("fp16+had", "apply to quantized formats"),
    ("native+out4", "apply to quantized formats"),
    ("int8+had+had", "each at most once"),
    ("int8+out4+out2", "each at most once"),
    ("int8+bogus", "bad option '+bogus'"),
    ("int8+out0", "at least one channel"),
    ("int8+out64", "leave none of head_dim 64"),
    ("k=int8", "give both k= and v="),
    ("k=int8,k=int4", "each once"),
    ("k=int8;v=int4", "names no layers"),
    ("0-3=int8;fp16", "names no layers"),
    ("0-3=int8;3-=fp16", "layer 3 is given twice"),
    ("0-3=int8;5-=fp16", "no format for layers 4"),
    ("0-3=int8;10-12=fp16", "no format for layers 4-9, 13-29"),
    ("0-30=int8", "beyond the model's layers 0-29"),
    ("5-2=int8", "is empty"),
    ("int8;", "empty segment"),
])
def test_bad_specs_raise_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        parse_kv_format(spec, L, F32, head_dim=D)


def test_hadamard_needs_a_power_of_two_head_dim():
    with pytest.raises(ValueError, match="power-of-two head_dim, got 96"):
        parse_kv_format("int8+had", L, F32, head_dim=96)
    fmt = parse_kv_format("int8+had", L, F32)                  # without head_dim: checked by parts()
    with pytest.raises(ValueError, match="power-of-two"):
        fmt.bytes_per_token(B, H, 96)
    assert parse_kv_format("int8", L, F32, head_dim=96).spec == "int8"


@pytest.mark.skipif(fp8_supported(), reason="only where torch lacks float8")
def test_fp8_without_torch_support_is_a_clear_error():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        parse_kv_format("fp8", L, F32)


# Bytes per token of SmolLM2 (30 layers, K and V, 3 KV heads, head_dim 64, blocks of 16):
# the table in docs/kv_formats.md.
SMOLLM2_BYTES_PER_TOKEN = {
    "fp32": 46_080, "fp16": 23_040, "bf16": 23_040, "fp8": 11_880, "int8": 11_880,
    "int4": 7_200, "int4g64": 6_480, "int2": 4_320, "kivi4": 7_920, "kivi2": 5_040, "kivi2g64": 4_680,
    "k=int8,v=int4": 9_540, "int8+out4": 13_365, "int4+out4": 8_685, "kivi2+out4": 6_525, "kivi4+out4": 9_405,
    "kivi2+had": 5_040, "k=kivi2+out4,v=kivi2": 5_782.5, "0-1=fp16;2-=kivi2": 2 * 768 + 28 * 168,
}


@pytest.mark.parametrize(("spec", "expected"), SMOLLM2_BYTES_PER_TOKEN.items())
def test_bytes_per_token_of_smollm2(spec, expected):
    if spec.startswith("fp8") and not fp8_supported():
        pytest.skip("torch without float8_e4m3fn")
    fmt = parse_kv_format(spec, L, F32, head_dim=D)
    assert fmt.bytes_per_token(B, H, D) == expected
    assert fmt.nbytes_per_block(B, H, D) == expected * B


def test_registry_holds_the_names_users_type():
    assert set(KV_FORMATS) == {"native", "fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2", "kivi4", "kivi2"}
