"""The planner's weights: exact bytes per weight format (by hand from the packing formulas, and
against engines), the KV budget a device leaves beside them, refusals, the report and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import TINY, tiny_model

from kvserve import LLM
from kvserve.cli import main
from kvserve.model.formats.packing import quantize_int4
from kvserve.model.loader import LoadedModel, default_model_path
from kvserve.plan import (
    BUILTIN_MODELS,
    GIB,
    KVLayout,
    ModelShape,
    PlanRequest,
    count_weights,
    load_gguf,
    load_model_shape,
    make_plan,
)

# SmolLM2-135M: 30 layers, hidden 576, MLP 1536, vocabulary 49,152, tied; Q 576 rows, K and V 192
L, H, F, V = 30, 576, 1536, 49152
LAYER = ((576, H), (192, H), (192, H), (576, H), (F, H), (F, H), (H, F))   # q, k, v, o, gate, up, down
NORMS = (2 * L + 1) * H
PARAMS = L * sum(r * c for r, c in LAYER) + V * H + NORMS


def int8(rows: int, cols: int, group: int | None = None) -> int:
    """rows x cols codes + a float16 scale per row and group (rows are multiples of 16 here)."""
    return rows * cols + rows * (cols // (group or cols)) * 2


def int4(rows: int, cols: int, group: int) -> int:
    """rows x cols 4-bit codes + a float16 scale and min per row and group."""
    return rows * cols // 2 + rows * (cols // group) * 4


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["plan", *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the model table's weight shapes ----------------------------------------------------------

@pytest.mark.parametrize("name, params", [
    ("Llama-2-7B", 6_738_415_616), ("Llama-2-13B", 13_015_864_320), ("Llama-2-70B", 68_976_648_192),
    ("Llama-3-8B", 8_030_261_248), ("Llama-3-70B", 70_553_706_496), ("Mistral-7B", 7_241_732_096),
    ("Qwen2-0.5B", 494_032_768), ("Qwen2-1.5B", 1_543_714_304), ("Qwen2-7B", 7_615_616_512),
    ("Qwen2-72B", 72_706_203_648), ("SmolLM2-135M", 134_515_008), ("SmolLM2-360M", 361_821_120),
    ("SmolLM2-1.7B", 1_711_376_384),
])
def test_builtin_models_have_their_published_parameter_counts(name: str, params: int) -> None:
    """The table's MLP widths, vocabularies and ties give each checkpoint's parameter count
    (matrices, norms, Qwen2's Q/K/V biases; a tied embedding once)."""
    native = count_weights(name, "native", "fp16")
    assert native.num_params == params
    assert native.nbytes == 2 * params and native.bits_per_param == 16


# --- SmolLM2-135M in every format, by hand -----------------------------------------------------

def test_smollm2_135m_native() -> None:
    assert PARAMS == 134_515_008
    assert count_weights("smollm2-135m", "native", "fp16").nbytes == 2 * PARAMS == 269_030_016
    assert count_weights("smollm2-135m", "native", "bf16").nbytes == 269_030_016
    assert count_weights("smollm2-135m", "native", "fp32").nbytes == 4 * PARAMS == 538_060_032


@pytest.mark.parametrize("fmt, layer, head, expected", [
    ("int8-ch", lambda r, c: int8(r, c), int8(V, H), 134_959_488),
    ("int8", lambda r, c: int8(r, c, 32), int8(V, H, 32), 142_955_136),        # int8 = int8-g32
    ("int8-g64", lambda r, c: int8(r, c, 64), int8(V, H, 64), 138_752_640),
    ("int4", lambda r, c: int4(r, c, 32), int8(V, H, 32), 96_506_496),
    ("int4-g64", lambda r, c: int4(r, c, 64), int8(V, H, 32), 89_870_976),
    # + 8 float32 columns per matrix, 8 int32 ids per product (Q/K/V and gate/up are one product each)
    ("int4+out8", lambda r, c: int4(r, c, 32) + 8 * r * 4, int8(V, H, 32), 101_486_976),
])
def test_smollm2_135m_quantized(fmt: str, layer: Callable[[int, int], int], head: int, expected: int) -> None:
    ids = L * 4 * 8 * 4 if "+out" in fmt else 0
    by_hand = L * sum(layer(r, c) for r, c in LAYER) + ids + head + 2 * NORMS      # norms in fp16
    w = count_weights("smollm2-135m", fmt, "fp16")
    assert w.nbytes == by_hand == expected
    assert w.num_params == PARAMS
    assert w.nbytes_of("embed_tokens (tied lm_head)") == head


def test_smollm2_135m_int4_plus_out8_is_what_the_engine_held() -> None:
    """Measured once: LLM(loaded=load_model(), weight_format="int4+out8").engine.model.weight_nbytes
    is 101,557,248 (the calibration takes ~45 s, too long to repeat here): norms in float32."""
    assert count_weights("smollm2-135m", "int4+out8", "fp32").nbytes == 101_557_248


# --- against engines ----------------------------------------------------------------------------

TINY_SHAPE = ModelShape.from_model_config(TINY, "tiny")


def resident_read_by_a_step(shape: ModelShape | str, fmt: str, loaded: LoadedModel | None = None) -> int:
    """The plan's bytes less an untied embedding table: what LlamaModel.weight_nbytes counts
    (a decode step reads the table's rows only); the engine on the CPU computes in float32."""
    w = count_weights(shape, fmt, "fp32", loaded)
    return w.nbytes - w.nbytes_of("embed_tokens")


@pytest.mark.parametrize("fmt", ["native", "int8", "int8-ch", "int8-g64", "int4", "int4-g64"])
def test_the_tiny_model_counts_what_the_engine_holds(fmt: str) -> None:
    assert TINY_SHAPE.intermediate_size == 128 and TINY_SHAPE.tie_word_embeddings is False
    engine = LLM(loaded=tiny_model(), weight_format=fmt, num_kv_blocks=16).engine
    assert resident_read_by_a_step(TINY_SHAPE, fmt) == engine.model.weight_nbytes


def test_tiny_int8_by_hand() -> None:
    layer = ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))
    w = count_weights(TINY_SHAPE, "int8-ch", "fp32")
    assert w.nbytes_of("embed_tokens") == w.nbytes_of("lm_head") == int8(128, 64)
    assert w.nbytes == 2 * sum(int8(r, c) for r, c in layer) + 2 * int8(128, 64) + 5 * 64 * 4 == 93_952


@pytest.mark.parametrize("fmt", ["native", "int8-g32"])
def test_qkv_biases_are_counted_as_the_engine_holds_them(fmt: str) -> None:
    """Qwen2's biases: float32 beside packed weights, the compute dtype under native."""
    config = replace(TINY, attention_bias=True)
    shape = ModelShape.from_model_config(config, "tiny-bias")
    engine = LLM(loaded=tiny_model(config), weight_format=fmt, num_kv_blocks=16).engine
    assert resident_read_by_a_step(shape, fmt) == engine.model.weight_nbytes
    biases = count_weights(shape, fmt, "fp16")
    assert biases.nbytes_of("q_proj.bias") == 2 * 64 * (4 if fmt != "native" else 2)


def test_gguf_counts_the_default_files_blocks(default_model: LoadedModel,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    engine_nbytes = LLM(loaded=default_model, kv_cache_memory_gb=0.02).engine.model.weight_nbytes
    path = str(default_model_path())
    got = plan_json(capsys, "--config", path, "--weight-format", "gguf", "--compute-dtype", "fp32")
    assert got["weights"]["nbytes"] == engine_nbytes == 96_576_768
    assert got["weights"]["num_params"] == PARAMS
    assert {(t["name"], t["format"]) for t in got["weights"]["tensors"]} >= {
        ("embed_tokens (tied lm_head)", "Q8_0"), ("q_proj", "Q4_1"), ("down_proj", "Q4_1")}
    auto = plan_json(capsys, "--config", path, "--weight-format", "auto", "--compute-dtype", "fp32")
    assert auto["weights"]["format"] == "gguf" and auto["weights"]["nbytes"] == engine_nbytes


def test_gguf_dequantizes_a_product_with_a_float_part() -> None:
    """A product with a part no kernel reads (float in the file) is dequantized whole, as the
    engine does: here layer 1's gate is float, so its gate/up is float32; every other matrix
    keeps its blocks."""
    weights = dict(tiny_model().weights)
    for name, w in list(weights.items()):
        if w.dim() == 2 and name != "model.layers.1.mlp.gate_proj.weight":
            weights[name] = quantize_int4(w, 32)
    loaded = LoadedModel(config=TINY, weights=weights, tokenizer=None,  # type: ignore[arg-type]
                         fingerprint="mixed", source="mixed")
    engine = LLM(loaded=loaded, weight_format="gguf", num_kv_blocks=16).engine
    assert resident_read_by_a_step(TINY_SHAPE, "gguf", loaded) == engine.model.weight_nbytes
    w = count_weights(TINY_SHAPE, "gguf", "fp32", loaded)
    assert {(r.name, r.format, r.num_tensors) for r in w.rows if r.name in ("gate_proj", "up_proj")} == {
        ("gate_proj", "int4", 1), ("gate_proj", "fp32", 1), ("up_proj", "int4", 1), ("up_proj", "fp32 (from int4)", 1)}
    assert w.nbytes_of("gate_proj") == int4(128, 64, 32) + 128 * 64 * 4


# --- a device's memory: weights first, the KV cache in what is left --------------------------------

def test_device_gb_leaves_the_kv_budget() -> None:
    weights = count_weights("smollm2-135m", "int8-ch", "fp16")
    layout = KVLayout.build("smollm2-135m", "fp16")
    plan = make_plan(layout, PlanRequest(context_tokens=2048, batch_size=4, device_bytes=GIB), weights)
    assert plan.kv_budget_nbytes == GIB - 134_959_488
    assert plan.device == layout.device_capacity(GIB - 134_959_488, 2048)
    assert plan.device is not None and plan.device.num_blocks == (GIB - 134_959_488) // 368_640 == 2_546
    assert plan.device.num_sequences == (GIB - 134_959_488) // (128 * 368_640) == 19
    assert plan.batch_fits is True
    # --memory-gb stays the KV budget, whatever the weights
    given = make_plan(layout, PlanRequest(context_tokens=2048, memory_bytes=GIB), weights)
    assert given.kv_budget_nbytes == GIB and given.weights == weights


def test_70b_in_int4_on_an_80_gib_device(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/plan.md's worked example: Llama-3-70B, int4 weights, fp16 KV, 8,192-token sequences."""
    hidden, ffn, vocab, layers = 8192, 28672, 128256, 80
    layer = ((8192, hidden), (1024, hidden), (1024, hidden), (8192, hidden), (ffn, hidden), (ffn, hidden),
             (hidden, ffn))
    by_hand = (layers * sum(int4(r, c, 32) for r, c in layer) + 2 * int8(vocab, hidden, 32)    # head, embedding
               + (2 * layers + 1) * hidden * 2)
    got = plan_json(capsys, "--model", "llama-3-70b", "--weight-format", "int4", "--device-gb", "80",
                       "--context", "8192")
    assert got["weights"]["nbytes"] == by_hand == 45_017_219_072
    assert got["weights"]["num_params"] == 70_553_706_496
    assert got["weights"]["bits_per_param"] == round(8 * by_hand / 70_553_706_496, 4)
    budget = 80 * GIB - by_hand
    assert got["device_memory"] == {"nbytes": 80 * GIB, "gib": 80.0, "weights_nbytes": by_hand,
                                    "kv_budget_nbytes": budget, "kv_budget_gib": budget / GIB}
    assert got["device"]["nbytes"] == budget
    assert got["device"]["num_tokens"] == budget // (16 * 327_680) * 16 == 124_752
    assert got["device"]["num_sequences"] == budget // (8192 * 327_680) == 15


def test_text_report_weights_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--weight-format", "int4", "--device-gb", "80",
                 "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "weights: Llama-3-70B in int4" in out
    assert "gate_proj                  28,672 x 8,192     80  int4-g32  18,790,481,920  11,744,051,200" in out
    assert "bytes               45,017,219,072 B (41.93 GiB)" in out and "bits per parameter  5.1" in out
    assert "device 85,899,345,920 B (80 GiB) = weights 41.93 GiB + KV budget 38.07 GiB" in out
    assert "KV budget 40,882,126,848 B (38.07 GiB)" in out and "sequences of 8,192 tokens  15" in out


def test_without_a_weight_format_the_report_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama-3-8b", "--context", "2048", "--memory-gb", "24"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "weights" not in text and "device " not in text
    got = plan_json(capsys, *args[1:])
    assert "weights" not in got and "device_memory" not in got
    with_weights = plan_json(capsys, *args[1:], "--weight-format", "int8")
    assert {k: v for k, v in with_weights.items() if k != "weights"} == got    # --memory-gb: the KV budget as given
    assert set(with_weights["weights"]) == {"format", "compute_dtype", "num_params", "nbytes", "gib",
                                            "bits_per_param", "tensors", "notes"}
    assert set(with_weights["weights"]["tensors"][0]) == {"name", "shape", "num_tensors", "format", "num_params",
                                                          "nbytes"}


def test_device_gb_alone_counts_the_engines_default_format(capsys: pytest.CaptureFixture[str]) -> None:
    got = plan_json(capsys, "--model", "smollm2-135m", "--device-gb", "1", "--context", "2048")
    assert got["weights"]["format"] == "native" and got["weights"]["nbytes"] == 2 * PARAMS
    assert "weight format auto counted as native" in got["weights"]["notes"][0]


# --- refusals ---------------------------------------------------------------------------------

def test_weights_that_do_not_fit_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-70b", "--weight-format", "native", "--device-gb", "80"]) == 2
    assert ("the weights of Llama-3-70B in native (141,107,412,992 B = 131.42 GiB) do not fit in the device's "
            "85,899,345,920 B (80.00 GiB)") in capsys.readouterr().err
    with pytest.raises(ValueError, match="count the weights too"):
        make_plan(KVLayout.build("smollm2-135m"), PlanRequest(context_tokens=16, device_bytes=GIB))
    with pytest.raises(ValueError, match="not both"):
        PlanRequest(context_tokens=16, device_bytes=GIB, memory_bytes=GIB)
    with pytest.raises(SystemExit):       # argparse: --memory-gb and --device-gb exclude each other
        main(["plan", "--memory-gb", "1", "--device-gb", "1"])


def test_gguf_needs_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="pass the .gguf with --config"):
        count_weights("llama-3-70b", "gguf")
    assert main(["plan", "--model", "smollm2-135m", "--weight-format", "gguf"]) == 2
    assert "weight format gguf counts a GGUF file's own quantized blocks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has none \\(float weights\\): use native, int8 or int4"):
        count_weights(TINY_SHAPE, "gguf", loaded=tiny_model())


@pytest.mark.parametrize("model, fmt, message", [
    ("smollm2-135m", "int4-g128", "int4-g128: model.layers.0.self_attn.qkv has 576 input columns, not a multiple"),
    ("qwen2-72b", "int8-g256", "int8-g256: model.layers.0.mlp.down_proj has 29568 input columns, not a multiple"),
    ("qwen2-72b", "int4-g256+out8", "model.layers.0.mlp.down_proj has 29568 input columns"),
    ("smollm2-135m", "int4-g48", "-g48: a group is a positive multiple of 32 columns"),
    ("smollm2-135m", "native+out4", r"\+out4: outlier protection keeps 1-64 channels, for int8 / int4 only"),
])
def test_a_group_the_engine_refuses_is_refused(model: str, fmt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        count_weights(model, fmt)


def test_a_group_the_engine_refuses_on_the_tiny_model_is_refused_the_same_way() -> None:
    with pytest.raises(ValueError) as planned:
        count_weights(TINY_SHAPE, "int4-g128")
    with pytest.raises(ValueError) as engine:
        LLM(loaded=tiny_model(), weight_format="int4-g128", num_kv_blocks=16)
    assert str(planned.value) == str(engine.value)


def test_shapes_without_the_mlp_or_vocabulary_cannot_be_counted(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(tmp_path)
    assert (shape.intermediate_size, shape.vocab_size, shape.tie_word_embeddings) == (None, None, None)
    with pytest.raises(ValueError, match="does not state its intermediate_size or vocab_size"):
        count_weights(shape, "int8")
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 128, "vocab_size": 100}))
    untold = count_weights(load_model_shape(tmp_path), "native")
    assert untold.nbytes_of("lm_head") == 100 * 64 * 2 and "counted untied" in untold.notes[0]


def test_sources_give_the_weight_shape(tmp_path: Path) -> None:
    qwen = {"model_type": "qwen2", "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "hidden_size": 896, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
            "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    shape = load_model_shape(tmp_path)
    table = BUILTIN_MODELS["Qwen2-0.5B"]
    assert replace(shape, name=table.name, note=table.note) == table
    gguf_shape, loaded = load_gguf(default_model_path())
    assert replace(gguf_shape, name="SmolLM2-135M", note=BUILTIN_MODELS["SmolLM2-135M"].note) == \
        BUILTIN_MODELS["SmolLM2-135M"]
    assert loaded.config.vocab_size == V
