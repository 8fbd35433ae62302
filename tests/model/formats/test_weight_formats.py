"""Weight formats end to end: a tiny GGUF file in every block type (written here, random
blocks), loaded packed, served in each format; prefix hits equal cold runs per format; the
format is part of the fingerprint; what cannot run is refused saying why."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from blocks import RoundingProducts
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.model import gguf_loader
from kvserve.model.formats.packing import PackedWeight, dequantize
from kvserve.model.formats.random_blocks import random_gguf_bytes
from kvserve.model.linear import as_float
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import LoadedModel, load_model

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 300
# every type the kernels read, products mixing them (Q, K, V), and Q3_K, which no kernel
# reads (its gate_up is dequantized: one log line)
UNREAD = "Q3_K"
TYPES = {
    "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K", "blk.0.attn_output": "Q4_0",
    "blk.0.ffn_gate": "Q4_1", "blk.0.ffn_up": "Q4_1", "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q8_0", "blk.1.attn_k": "Q5_0", "blk.1.attn_v": "Q5_1", "blk.1.attn_output": "Q4_K",
    "blk.1.ffn_gate": UNREAD, "blk.1.ffn_up": "Q4_0", "blk.1.ffn_down": "Q5_K",
    "token_embd": "Q8_0",
}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN), "token_embd": (VOCAB, HIDDEN)}


def write_quantized_gguf(path: Path, tokenizer) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF (hidden 256, 4 heads of 64, 2 KV heads, tied embedding) whose
    matrices are random blocks of TYPES; returns each matrix's raw bytes by GGUF name."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([tokenizer.id_to_token(i) for i in range(VOCAB)])
    w.add_token_types([3 if i < 17 else 1 for i in range(VOCAB)])
    w.add_eos_token_id(2)
    w.add_chat_template(tokenizer.chat_template)
    raw: dict[str, np.ndarray] = {}
    for seed, (name, type_name) in enumerate(TYPES.items()):
        rows, cols = SHAPES[name.rpartition(".")[2]]
        data = random_gguf_bytes(type_name, rows, cols, seed)
        raw[name] = data
        w.add_tensor(f"{name}.weight", data.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType[type_name])
    rng = np.random.default_rng(99)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm", "blk.1.attn_norm", "blk.1.ffn_norm"):
        w.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, default_model) -> tuple[LoadedModel, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("qgguf")
    raw = write_quantized_gguf(folder / "tiny-q.gguf", default_model.tokenizer)
    return load_model(str(folder / "tiny-q.gguf"), cache_dir=folder / "cache"), raw


def test_the_files_blocks_load_packed_with_their_exact_values(quantized) -> None:
    loaded, raw = quantized
    w = loaded.weights
    for name, type_name in TYPES.items():
        hf = gguf_loader.hf_name(f"{name}.weight")
        rows = SHAPES[name.rpartition(".")[2]][0]
        expected = gguf.quants.dequantize(raw[name].reshape(rows, -1), gguf.GGMLQuantizationType[type_name])
        if name.endswith(("attn_q", "attn_k")):          # llama.cpp's row order undone
            expected = gguf_loader.unpermute_rows(expected, HEADS if name.endswith("attn_q") else KV_HEADS)
        assert torch.equal(as_float(w[hf]), torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))), name
        assert isinstance(w[hf], PackedWeight) == (type_name != UNREAD), name
        if isinstance(w[hf], PackedWeight):
            assert w[hf].format_name == type_name


def test_the_loader_names_the_types_it_dequantizes(quantized, caplog) -> None:
    """A type no kernel reads (Q3_K here; Q2_K and the IQ types alike) is dequantized to float32
    at load, one log line naming it and its count; the Q5 types are not among them."""
    loaded, _ = quantized
    with caplog.at_level("INFO", logger=gguf_loader.__name__):
        gguf_loader.convert_gguf(Path(loaded.source))
    said = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert len(said) == 1 and f"1 {UNREAD} tensors" in said[0] and "Q5" not in said[0], said


def test_auto_is_gguf_for_a_quantized_file_and_native_for_float_weights(quantized, caplog) -> None:
    loaded, _ = quantized
    with caplog.at_level("INFO"):
        llm = LLM(loaded=loaded, kv_cache_memory_gb=0.02)
    assert llm.engine.weight_format == "gguf"
    # layer 1's gate (Q3_K) makes its gate_up a float product, said once
    assert sum("model.layers.1.mlp.gate_up is dequantized" in r.getMessage() for r in caplog.records) == 1
    assert LLM(loaded=tiny_model(), num_kv_blocks=16).engine.weight_format == "native"


def test_a_gguf_model_computes_what_float_weights_do_with_the_kernels_rounding(quantized) -> None:
    """The whole model on the file's blocks (every type, a Q/K/V of three kinds, a dequantized
    gate_up) against float weights whose products round their activations as the kernels do
    (blocks.RoundingProducts): the logits agree to 1e-3 of their spread (float32 summation
    order, and a prologue's last bit now and then rounding one activation the other way;
    measured: 2e-7). Against plain float weights they differ by what the rounding costs
    (measured: 1e-2 of the spread on these random weights)."""
    loaded, _ = quantized
    prompt = torch.tensor(random_tokens(40, seed=3, vocab_size=VOCAB))
    llm = LLM(loaded=loaded, kv_cache_memory_gb=0.02)
    model = llm.engine.model
    reference = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32, RoundingProducts())
    native = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    logits = {name: dense_logits(m, prompt) for name, m in (("gguf", model), ("rounded", reference),
                                                           ("float", native))}
    spread = float(logits["rounded"].max() - logits["rounded"].min())
    assert float((logits["gguf"] - logits["rounded"]).abs().max()) < 1e-3 * spread
    assert float((logits["gguf"] - logits["float"]).abs().max()) > 1e-3 * spread     # the rounding is real


def dense_logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """Last-token logits of a dense causal forward (no paged cache)."""
    with torch.inference_mode():
        angles = model.angles(torch.arange(ids.numel()))
        h = model.embed(ids)
        for layer in range(model.config.num_layers):
            q, k, v = model.layer_qkv(layer, h, angles)
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=model.scale,
                enable_gqa=True)
            h = model.layer_output(layer, h, o.transpose(0, 1))
        return model.compute_logits(model.final_norm_of(h[-1:]))[0]


@pytest.mark.parametrize("fmt", ["gguf", "native", "int8", "int4", "int4-g64+out4"])
def test_a_prefix_hit_gives_the_cold_runs_tokens(quantized, fmt) -> None:
    loaded, _ = quantized
    prompts = [random_tokens(n, seed=n, vocab_size=VOCAB) for n in (37, 50, 70)]
    shared = random_tokens(48, seed=1, vocab_size=VOCAB)
    prompts = [shared + p for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    opts = {"weight_format": fmt, "kv_cache_memory_gb": 0.02, "max_num_batched_tokens": 32}
    cold = LLM(loaded=loaded, enable_prefix_caching=False, **opts).generate(prompts, params)
    warm_llm = LLM(loaded=loaded, **opts)
    warm_llm.generate(prompts[:1], params)
    warm = warm_llm.generate(prompts, params)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert all(o.num_cached_tokens >= 48 for o in warm)
    warm_llm.engine.check_integrity()


def test_the_fingerprint_names_the_weight_format(quantized) -> None:
    loaded, _ = quantized
    keys = {f: LLM(loaded=loaded, weight_format=f, kv_cache_memory_gb=0.02).engine.model_card.extra_key
            for f in ("native", "gguf", "int8", "int4", "int4+out4")}
    assert len(set(keys.values())) == len(keys)
    again = LLM(loaded=loaded, weight_format="auto", kv_cache_memory_gb=0.02).engine.model_card.extra_key
    assert again == keys["gguf"]


@pytest.mark.parametrize(("fmt", "message"), [
    ("int5", "weight format 'int5' is not one of auto, native, gguf, int8, int4"),
    ("int8-g48", "-g48: a group is a positive multiple of 32 columns"),
    ("native+out8", r"\+out8: outlier protection keeps 1-64 channels, for int8 / int4 only"),
    ("int4-g96", "model.layers.0.self_attn.qkv has 256 input columns, not a multiple of 96"),
])
def test_a_format_that_cannot_run_is_refused_saying_why(quantized, fmt, message) -> None:
    loaded, _ = quantized
    with pytest.raises(ValueError, match=message):
        LLM(loaded=loaded, weight_format=fmt, kv_cache_memory_gb=0.02)


def test_gguf_needs_quantized_blocks() -> None:
    with pytest.raises(ValueError, match="weight format gguf keeps a GGUF file's quantized blocks"):
        LLM(loaded=tiny_model(), weight_format="gguf", num_kv_blocks=16)


def test_the_converted_weights_cache_keeps_the_blocks(quantized, tmp_path) -> None:
    loaded, _ = quantized
    again = load_model(loaded.source, cache_dir=Path(loaded.source).parent / "cache")
    for name, w in loaded.weights.items():
        other = again.weights[name]
        if isinstance(w, PackedWeight):
            assert isinstance(other, PackedWeight) and torch.equal(dequantize(other), dequantize(w)), name
            assert all(torch.equal(a.parts[k], b.parts[k]) for a, b in zip(w.segments, other.segments)
                       for k in a.parts), name
        else:
            assert torch.equal(other, w), name


def test_the_default_models_weights_resident_in_gguf_are_the_files_size(default_model) -> None:
    """Goal: at most 1.1x the GGUF file (the blocks moved, norms in float32, nothing else)."""
    size = Path(default_model.source).stat().st_size
    gguf_bytes = LLM(loaded=default_model, kv_cache_memory_gb=0.02).engine.model.weight_nbytes
    assert gguf_bytes <= 1.1 * size
    assert gguf_bytes == sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * 4
                             for w in default_model.weights.values())
