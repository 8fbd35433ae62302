"""The KV memory planner: exact byte counts for real model shapes, every format, sharing, tiers, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.config import ModelConfig
from kvserve.plan import (
    BUILTIN_MODELS,
    FORMATS,
    GIB,
    TIER_BLOCK_HEADER_NBYTES,
    KVLayout,
    ModelShape,
    PlanRequest,
    load_model_shape,
    lookup_model,
    make_plan,
    resolve_model,
)

B, G = 16, 32


def per_token(model: str, kv_format: str, **kw: str) -> float:
    return KVLayout.build(model, kv_format, **kw).bytes_per_token


# --- the built-in table ----------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, heads, kv_heads, head_dim, hidden, context, ffn, vocab, tied", [
    ("Llama-2-7B", 32, 32, 32, 128, 4096, 4096, 11008, 32000, False),
    ("Llama-2-13B", 40, 40, 40, 128, 5120, 4096, 13824, 32000, False),
    ("Llama-2-70B", 80, 64, 8, 128, 8192, 4096, 28672, 32000, False),
    ("Llama-3-8B", 32, 32, 8, 128, 4096, 8192, 14336, 128256, False),
    ("Llama-3-70B", 80, 64, 8, 128, 8192, 8192, 28672, 128256, False),
    ("Mistral-7B", 32, 32, 8, 128, 4096, 32768, 14336, 32000, False),
    ("Qwen2-0.5B", 24, 14, 2, 64, 896, 32768, 4864, 151936, True),
    ("Qwen2-1.5B", 28, 12, 2, 128, 1536, 32768, 8960, 151936, True),
    ("Qwen2-7B", 28, 28, 4, 128, 3584, 131072, 18944, 152064, False),
    ("Qwen2-72B", 80, 64, 8, 128, 8192, 131072, 29568, 152064, False),
    ("SmolLM2-135M", 30, 9, 3, 64, 576, 8192, 1536, 49152, True),
    ("SmolLM2-360M", 32, 15, 5, 64, 960, 8192, 2560, 49152, True),
    ("SmolLM2-1.7B", 24, 32, 32, 64, 2048, 8192, 8192, 49152, True),
])
def test_builtin_shapes(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int,
                        context: int, ffn: int, vocab: int, tied: bool) -> None:
    assert BUILTIN_MODELS[name] == ModelShape(name, layers, heads, kv_heads, head_dim, hidden, context,
                                              BUILTIN_MODELS[name].note, intermediate_size=ffn, vocab_size=vocab,
                                              tie_word_embeddings=tied, attention_bias=name.startswith("Qwen2"))


@pytest.mark.parametrize("alias, name", [
    ("llama-3-70b", "Llama-3-70B"), ("meta-llama/Meta-Llama-3-70B", "Llama-3-70B"),
    ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B"), ("LLAMA3-8B", "Llama-3-8B"),
    ("meta-llama/Llama-2-70b-chat-hf", "Llama-2-70B"), ("llama2-7b", "Llama-2-7B"),
    ("mistralai/Mistral-7B-Instruct-v0.2", "Mistral-7B"), ("Qwen/Qwen2-0.5B-Instruct", "Qwen2-0.5B"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M"), ("smollm2-1.7b", "SmolLM2-1.7B"),
])
def test_names_and_aliases(alias: str, name: str) -> None:
    assert lookup_model(alias) is BUILTIN_MODELS[name]


def test_unknown_model_is_a_value_error() -> None:
    assert lookup_model("llama-4-400b") is None
    with pytest.raises(ValueError, match="unknown model 'llama-4-400b'"):
        resolve_model("llama-4-400b")


# --- bytes per token -------------------------------------------------------------------------

def test_full_precision_bytes_per_token() -> None:
    assert per_token("smollm2-135m", "fp32") == 46_080 == 30 * 2 * 3 * 64 * 4
    assert per_token("smollm2-135m", "fp16") == 23_040
    assert per_token("llama-2-70b", "fp16") == 327_680 == 80 * 2 * 8 * 128 * 2
    assert per_token("llama-3-70b", "fp16") == 327_680
    assert per_token("llama-2-7b", "fp16") == 524_288 == 32 * 2 * 32 * 128 * 2
    assert per_token("llama-3-8b", "fp16") == 131_072 == per_token("llama-3-8b", "bf16")


@pytest.mark.parametrize("model, d, layer_heads", [("smollm2-135m", 64, 30 * 3), ("llama-3-8b", 128, 32 * 8)])
def test_quantized_formulas(model: str, d: int, layer_heads: int) -> None:
    expected = {  # per token, per layer, per KV head: the formulas of formats.py
        "fp32": 8 * d, "fp16": 4 * d, "bf16": 4 * d, "fp8": 2 * (d + 2), "int8": 2 * (d + 2),
        "int4": 2 * (d // 2 + 4 * d // G),
        "kivi4": (4 * d // 8 + 4 * d // B) + (4 * d // 8 + 4 * d // G),
        "kivi2": (2 * d // 8 + 4 * d // B) + (2 * d // 8 + 4 * d // G),
    }
    assert set(expected) == set(FORMATS)
    for name, nbytes in expected.items():
        assert per_token(model, name) == layer_heads * nbytes, name


@pytest.mark.parametrize("head_dim", [64, 128])
def test_codec_registry_matches_the_format_table(head_dim: int) -> None:
    """formats.py is what the planner counts; the engine's codecs are what it stores."""
    registry = pytest.importorskip("kvserve.kv.codecs.registry")
    import torch

    for name, fmt in FORMATS.items():
        for half, layout in (("k", fmt.key), ("v", fmt.value)):
            codec = registry.KV_FORMATS[name](registry.CodecArgs(half, torch.float16))
            assert codec.nbytes_per_block(B, 1, head_dim) == layout.block_nbytes(head_dim, B), (name, half)


def test_quantized_numbers_on_smollm2_135m() -> None:
    got = {name: per_token("smollm2-135m", name) for name in ("int8", "int4", "kivi4", "kivi2")}
    assert got == {"int8": 11_880, "int4": 7_200, "kivi4": 7_920, "kivi2": 5_040}


def test_key_and_value_formats_mix_halves() -> None:
    # K: int8's key half (130 B at D=128), V: int4's value half (80 B); 32 layers x 8 KV heads
    assert per_token("llama-3-8b", "fp16", key_format="int8", value_format="int4") == 256 * (130 + 80)
    assert per_token("llama-3-8b", "int4", key_format="fp16") == 256 * (256 + 80)


def test_per_layer_formats_sum_over_layers() -> None:
    layout = KVLayout.build("llama-3-8b", ["fp16"] * 16 + ["int8"] * 16)
    assert layout.bytes_per_token == 16 * 8 * 512 + 16 * 8 * 260
    assert layout.format_name == "per-layer"
    mixed = KVLayout.build("smollm2-135m", [("int8", "int4")] * 30)
    assert mixed.bytes_per_token == 90 * (66 + 40) and mixed.format_name == "k:int8,v:int4"
    with pytest.raises(ValueError, match="3 per-layer KV formats given for a model of 32 layers"):
        KVLayout.build("llama-3-8b", ["fp16"] * 3)
    with pytest.raises(ValueError, match="unknown KV format 'int3'"):
        KVLayout.build("llama-3-8b", "int3")


def test_a_zip_format_costs_its_base_plus_the_salient_share_and_a_residual_of_every_half() -> None:
    layout = KVLayout.build("smollm2-135m", "zip:hi=int8,lo=kivi2,salient=0.2")
    assert layout.block_nbytes == 80_640 + 38_016 and layout.bytes_per_token == 7_416
    assert layout.residual_nbytes == 60 * 16 * 3 * 64 * 2           # every half, fp16 compute
    assert layout.sequence_nbytes(4_096) == 256 * 118_656 + 368_640


# --- sequences, batches, budgets --------------------------------------------------------------

def test_70b_serving_100_requests_of_2048_tokens() -> None:
    layout = KVLayout.build("llama-2-70b", "fp16")
    plan = make_plan(layout, PlanRequest(context_tokens=2048, batch_size=100, memory_bytes=80 * GIB))
    assert plan.sequence_nbytes == 2048 * 327_680
    assert plan.batch_nbytes == 67_108_864_000 == 62.5 * GIB
    assert plan.device is not None and plan.device.num_tokens == 262_144 and plan.device.num_sequences == 128
    assert plan.batch_fits is True
    assert plan.compression(plan.fp32) == 2.0 and plan.compression(plan.fp16) == 1.0


def test_sequences_are_whole_blocks() -> None:
    layout = KVLayout.build("llama-3-8b", "fp16")
    assert layout.sequence_nbytes(1) == B * 131_072
    assert layout.sequence_nbytes(2000) == 125 * B * 131_072       # 2000 tokens = exactly 125 blocks
    assert layout.sequence_nbytes(2001) == 126 * B * 131_072


def test_sequences_that_fit_in_24_gib() -> None:
    fp16 = KVLayout.build("llama-3-8b", "fp16")
    cap = fp16.device_capacity(24 * GIB, 2000)
    assert cap.num_blocks == 12_288 and cap.num_tokens == 196_608
    assert cap.num_sequences == 98 == 24 * GIB // (125 * B * 131_072)
    assert KVLayout.build("llama-2-7b", "fp16").device_capacity(24 * GIB, 4096).num_sequences == 12
    # 17 tokens take 2 blocks of 16: 34,952 sequences, not the 65,793 that 17 x 23,040 bytes would give
    assert KVLayout.build("smollm2-135m", "fp16").device_capacity(24 * GIB, 17).num_sequences == 34_952
    kivi = KVLayout.build("llama-3-8b", "kivi4")
    assert kivi.device_capacity(24 * GIB, 2000).num_sequences == 24 * GIB // (125 * B * 45_056 + B * 65_536)


def test_kivi_residual_is_one_full_precision_block_of_keys_per_sequence() -> None:
    # per token: K 24,576 B (per channel over a block), V 20,480 B (per token, stored as it comes)
    layout = KVLayout.build("llama-3-8b", "kivi4")
    assert layout.residual_nbytes == B * 65_536                    # the open block's keys, fp16
    assert KVLayout.build("llama-3-8b", "kivi4", compute_format="fp32").residual_nbytes == B * 131_072
    assert layout.sequence_nbytes(2048) == 128 * B * 45_056 + B * 65_536
    assert layout.sequence_nbytes(2000) == 125 * B * 45_056 + B * 65_536
    # the 8 open tokens: keys in the residual, values in a quantized block
    assert layout.sequence_nbytes(2008) == 125 * B * 45_056 + B * 20_480 + B * 65_536
    plan = make_plan(layout, PlanRequest(context_tokens=2048, batch_size=10))
    assert plan.batch_nbytes == 10 * (128 * B * 45_056) + 10 * B * 65_536
    assert KVLayout.build("llama-3-8b", "int8").residual_nbytes == 0


# --- prefix sharing ---------------------------------------------------------------------------

def test_sharing_a_1000_token_system_prompt_across_1000_users() -> None:
    layout = KVLayout.build("llama-3-8b", "fp16")
    s = layout.prefix_sharing(prefix_tokens=1000, num_users=1000, context_tokens=1000)
    assert s.shared_blocks == 62 and s.shared_tokens == 992
    assert s.saved_nbytes == 999 * 992 * 131_072 == 129_893_400_576
    assert s.without_sharing_nbytes == 1000 * 63 * B * 131_072
    assert s.with_sharing_nbytes == (62 + 1000 * 1) * B * 131_072       # shared blocks once + each user's partial block
    longer = layout.prefix_sharing(1000, 1000, 4096)
    assert longer.saved_nbytes == s.saved_nbytes


def test_sharing_edges() -> None:
    layout = KVLayout.build("smollm2-135m", "int8")
    assert layout.prefix_sharing(15, 100, 100).saved_nbytes == 0   # no full block to share
    assert layout.prefix_sharing(16, 100, 100).saved_nbytes == 99 * layout.block_nbytes
    assert layout.prefix_sharing(1000, 1, 1000).saved_nbytes == 0
    with pytest.raises(ValueError, match="must be 1 to the context length"):
        layout.prefix_sharing(200, 2, 100)


# --- tiers ------------------------------------------------------------------------------------

def test_tiers_store_blocks_with_a_64_byte_header() -> None:
    assert TIER_BLOCK_HEADER_NBYTES == 64
    layout = KVLayout.build("llama-3-8b", "fp16")
    host = layout.tier_capacity(64 * GIB, 2048)
    assert host.num_blocks == 64 * GIB // (2 * 1024 * 1024 + 64) == 32_767
    assert host.num_tokens == 32_767 * B and host.num_sequences == 32_767 // 128
    assert layout.tier_capacity(GIB, 10).num_sequences is None      # no full block to offload
    plan = make_plan(layout, PlanRequest(context_tokens=2048, tier_nbytes=(("host", 64 * GIB), ("disk", 500 * GIB))))
    assert [name for name, _ in plan.tiers] == ["host", "disk"] and plan.tiers[0][1] == host


# --- sources of shapes ------------------------------------------------------------------------

def test_hf_config_json_and_directory(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "max_position_embeddings": 8192, "_name_or_path": "my-llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for source in (tmp_path / "config.json", tmp_path):
        shape = load_model_shape(source)
        assert (shape.name, shape.head_dim, shape.max_context) == ("my-llama", 128, 8192)
        assert KVLayout.build(shape).bytes_per_token == 131_072
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32}
    (tmp_path / "mha.json").write_text(json.dumps(mha))
    shape = load_model_shape(tmp_path / "mha.json")
    assert (shape.num_kv_heads, shape.head_dim, shape.max_context) == (4, 32, None)
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_shape(tmp_path / "bad.json")


def test_model_config_is_accepted_directly() -> None:
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
    assert KVLayout.build(config, "fp32").bytes_per_token == 46_080


def test_default_gguf_has_the_table_shape() -> None:
    from kvserve.model.loader import default_model_path

    shape = load_model_shape(default_model_path())
    table = BUILTIN_MODELS["SmolLM2-135M"]
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.max_context) == (
        table.num_layers, table.num_heads, table.num_kv_heads, table.head_dim, table.max_context)


def test_plan_request_validation() -> None:
    with pytest.raises(ValueError, match="both"):
        PlanRequest(context_tokens=10, prefix_tokens=5)
    with pytest.raises(ValueError, match="context length"):
        PlanRequest(context_tokens=0)
    with pytest.raises(ValueError, match="budget"):
        PlanRequest(context_tokens=10, memory_bytes=0)


# --- the CLI ----------------------------------------------------------------------------------

def test_cli_70b_question(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--context", "2048", "--batch", "100", "--kv-format", "fp16",
                 "--memory-gb", "80", "--host-gb", "64", "--disk-gb", "500"]) == 0
    out = capsys.readouterr().out
    assert "327,680 B (320 KiB)" in out
    assert "batch of 100 x 2,048 tokens" in out and "67,108,864,000 B (62.5 GiB)" in out
    assert "fits (78.1% of the budget)" in out
    host = 64 * GIB // (327_680 * B + 64)
    assert f"{host:,}" in out and f"{host * B:,}" in out


def test_cli_sharing_question(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "meta-llama/Meta-Llama-3-8B", "--context", "1000",
                 "--shared-prefix-tokens", "1000", "--users", "1000"]) == 0
    out = capsys.readouterr().out
    assert "62 full blocks = 992 tokens" in out
    assert f"{999 * 992 * 131_072:,} B" in out and "= 999 x 992 tokens" in out


def test_cli_json_matches_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "smollm2-135m", "--context", "2000", "--batch", "3", "--kv-format", "kivi4",
                 "--memory-gb", "24", "--redis-gb", "1", "--json", "-"]) == 0
    got = json.loads(capsys.readouterr().out)
    layout = KVLayout.build("smollm2-135m", "kivi4")
    assert got["bytes_per_token"] == 7_920 and got["residual_nbytes_per_sequence"] == layout.residual_nbytes
    assert got["batch_nbytes"] == 3 * layout.sequence_nbytes(2000)
    assert got["device"]["num_sequences"] == layout.device_capacity(24 * GIB, 2000).num_sequences
    assert got["tiers"][0]["name"] == "redis" and got["tier_block_header_nbytes"] == 64


def test_cli_lists_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILTIN_MODELS) and "327,680" in out
    assert main(["plan", "--model", "llama-3-8b", "--list-formats"]) == 0
    assert "kivi2" in capsys.readouterr().out
    assert main(["plan", "--model", "llama-3-8b", "--shared-prefix-tokens", "100"]) == 2
    assert "give both" in capsys.readouterr().err
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert main(["plan", "--model", "llama-3-8b", "--key-format", "int8", "--value-format", "int4"]) == 0
    assert "format k:int8,v:int4" in capsys.readouterr().out


def test_cli_kv_format_defaults_to_the_engines_auto_16_bit_kv(capsys: pytest.CaptureFixture[str]) -> None:
    """No --kv-format plans the engine's default, auto: 16-bit KV, the compute dtype's own at fp16
    (native), fp16 over an fp32 compute dtype (a CPU engine's default)."""
    def plan(*args: str) -> dict:
        assert main(["plan", "--model", "llama-3-8b", "--context", "1000", *args, "--json", "-"]) == 0
        return json.loads(capsys.readouterr().out)

    assert plan() == plan("--kv-format", "native") == plan("--kv-format", "fp16")
    fp32_auto, fp32_native = plan("--compute-dtype", "fp32"), plan("--compute-dtype", "fp32", "--kv-format", "native")
    assert fp32_auto["kv_format"] == "fp16" and fp32_native["kv_format"] == "fp32"
    assert fp32_native["bytes_per_token"] == 2 * fp32_auto["bytes_per_token"] == 2 * plan()["bytes_per_token"]


# --- one source: the engine's codecs ------------------------------------------------------------

def test_engine_specs_are_planned_from_their_codecs() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads, D = 64
    assert per_token("smollm2-135m", "kivi2+had") == per_token("smollm2-135m", "kivi2") == 90 * 56
    assert per_token("smollm2-135m", "int4g64") == 90 * 2 * (32 + 4)              # D/2 + 4D/64 per half
    assert per_token("smollm2-135m", "int8+out4") == 90 * 2 * (66 + 8 + 4 / B)   # + 2N per token, N per block
    layout = KVLayout.build("smollm2-135m", "0-9=fp16;10-=kivi2")
    assert layout.format_name == "per-layer"
    assert layout.bytes_per_token == 10 * 3 * 256 + 20 * 3 * 56
    assert layout.residual_nbytes == 20 * B * 3 * 64 * 2          # the 20 KIVI layers keep their open block's keys
    assert KVLayout.build("smollm2-135m", "kivi2+had").format_name == "kivi2+had"


def test_only_halves_that_encode_whole_blocks_keep_their_open_block_in_full() -> None:
    # as the engine: a residual row holds the halves whose codecs encode whole blocks
    mixed = KVLayout.build("llama-3-8b", "fp16", key_format="kivi2", value_format="int4")
    assert mixed.format_name == "k:kivi2,v:int4"
    assert mixed.residual_nbytes == 32 * B * 8 * 128 * 2
    assert KVLayout.build("llama-3-8b", "int4+out2").residual_nbytes == 32 * 2 * B * 8 * 128 * 2


def test_which_codecs_encode_whole_blocks() -> None:
    import torch

    from kvserve.kv.codecs import parse_codec

    def whole(token: str, half: str) -> bool:
        return parse_codec(token, half, torch.float16).encodes_whole_blocks  # type: ignore[arg-type]

    assert [whole(t, "k") for t in ("fp16", "int8", "fp8", "int4", "kivi2", "kivi4+had", "int8+out2")] == [
        False, False, False, False, True, True, True]
    assert [whole(t, "v") for t in ("kivi2", "kivi4+had", "kivi2+out2")] == [False, False, True]


def test_sliding_window_layers_hold_their_window_only():
    """Gemma 3 270M, fp16: 3 full-attention layers hold every block, 15 sliding ones their
    512-token window's 32 blocks and the open one, 16,384 bytes a layer's block."""
    layout = KVLayout.build("gemma-3-270m", "fp16")
    assert layout.model.sliding_layers == tuple(i for i in range(18) if (i + 1) % 6)
    assert layout.bytes_per_token_by_kind() == {"full": 3 * 1024, "sliding": 15 * 1024}
    assert layout.sequence_nbytes(8192) == 3 * 512 * 16384 + 15 * 33 * 16384
    assert layout.sequence_nbytes(100) == 18 * 7 * 16384          # within the window: every block
    assert layout.sequence_nbytes(8192) / (512 * layout.block_nbytes) < 0.3
