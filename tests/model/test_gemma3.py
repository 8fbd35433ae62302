"""Gemma 3 against transformers' ``Gemma3ForCausalLM`` on the same weights: tiny random-weight
configs whose window is shorter than the context, through prefill chunks and decode steps that
cross block and window edges, on every attention backend."""

from __future__ import annotations

import pytest
import torch
from model.test_llama_vs_hf import check_against

from kvserve import LLM
from kvserve.attention.backends import ATTENTION_BACKENDS
from kvserve.config import ModelConfig
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.hf_loader import config_from_hf
from kvserve.model.loaded import LoadedModel

WINDOW = 8


def tiny_gemma3(seed: int = 0, window: int = WINDOW, num_layers: int = 6) -> tuple[LoadedModel, object]:
    """A tiny Gemma 3 (5 sliding layers of ``window`` positions, then a full one) with random
    weights, ours and transformers' over the same tensors."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hcfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                            max_position_embeddings=512, query_pre_attn_scalar=24, rope_local_base_freq=100.0)
    config = config_from_hf(hcfg.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}, {}, "tiny")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(hcfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):      # scales by 1 + weight: not all ones
                t.copy_(0.2 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return LoadedModel(config=config, weights=weights, tokenizer=None,  # type: ignore[arg-type]
                       fingerprint=f"tiny-gemma3-{seed}", source="random"), model


def test_config_from_transformers() -> None:
    loaded, _ = tiny_gemma3()
    c: ModelConfig = loaded.config
    assert c.architecture == "gemma3_text" and c.num_layers == 6
    assert c.sliding_windows == (WINDOW,) * 5 + (None,)
    assert [s.rope_theta for s in c.layer_specs] == [100.0] * 5 + [1_000_000.0]
    assert (c.activation, c.qk_norm, c.sandwich_norms) == ("gelu_tanh", True, True)
    assert c.embedding_multiplier == 8.0 and c.query_scale == 24 ** -0.5 and c.tie_word_embeddings
    assert c.final_logit_softcapping is None and c.has_sliding_layers
    assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("backend", [b for b in ATTENTION_BACKENDS if b != "triton"])
def test_tiny_gemma3_matches_transformers(backend: str) -> None:
    loaded, reference = tiny_gemma3(seed=3)
    prompt = [(i * 37) % 128 for i in range(45)]
    # 16-token chunks over 4-token blocks: chunks and decode steps cross block and window edges
    llm = LLM(kv_format="native", loaded=loaded, block_size=4, max_num_batched_tokens=16, attention_backend=backend, num_kv_blocks=2000)
    assert isinstance(llm.engine.model, Gemma3Model)
    check_against(llm, reference, prompt, max_tokens=12)


def test_a_window_longer_than_the_context_is_full_attention() -> None:
    """Window 64 over 45 + 8 positions: every layer sees everything, as transformers' does."""
    loaded, reference = tiny_gemma3(seed=5, window=64)
    llm = LLM(kv_format="native", loaded=loaded, block_size=4, max_num_batched_tokens=16, num_kv_blocks=2000)
    check_against(llm, reference, [(i * 13) % 128 for i in range(45)], max_tokens=8)


def test_the_transformers_baseline_of_eval_and_bench_is_the_same_model() -> None:
    """``hf_model_from`` (the baseline of kvserve eval and the benchmarks) builds transformers'
    Gemma 3 from our config and weights: the same logits as the reference built directly."""
    from kvserve.bench.common import hf_model_from
    from kvserve.model.families import family_of

    loaded, reference = tiny_gemma3(seed=6)
    assert config_from_hf(family_of(loaded.config).hf_config_dict(loaded.config), {}, "again") == loaded.config
    rebuilt = hf_model_from(loaded, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[(i * 7) % 128 for i in range(30)]])
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids).logits, reference(ids).logits)


def test_the_cpu_norm_kernels_equal_their_torch_forms() -> None:
    """Gemma's q/k norm then RoPE, and a norm added into the residual: the C++ calls (CPU,
    float32) against the torch forms the other devices run, on a prefill's rows."""
    from kvserve.model.cpu_extension import load_extension
    from kvserve.model.linear import rms_norm
    from kvserve.model.rope import Rope, RopeBase

    ext = load_extension()
    if ext is None:
        pytest.skip("the C++ model kernels are not built here")
    g = torch.Generator().manual_seed(0)
    rope = Rope(RopeBase(10000.0, None, 16, 64), 4, 2, torch.device("cpu"), torch.float32)
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=g) * 3
    qw, kw = torch.randn(16, generator=g), torch.randn(16, generator=g)
    angles = rope.angles(torch.tensor([0, 1, 5, 9, 20, 40, 63]))
    q, k = rope.qk_normed(qkv, angles, qw, kw, 1e-6)
    rope.ext = None
    q_ref, k_ref = rope.qk_normed(qkv, angles, qw, kw, 1e-6)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
    h, x, w = torch.randn(7, 64, generator=g), torch.randn(7, 64, generator=g) * 5, torch.randn(64, generator=g)
    want = h + rms_norm(x, w, 1e-6)
    ext.norm_add(h, x, w, 1e-6)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
