"""Our paged-attention model against Hugging Face transformers on the same weights.

Logprobs are log-softmax of the logits, so comparing the logprob of every prompt
token, every generated token and their top-20 alternatives compares the logits.
"""

from __future__ import annotations

import pytest
import torch
from tiny import TINY, random_weights, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig

TOL = 2e-4   # fp32, absolute, on logprobs


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls_cfg, cls_model = (Qwen2Config, Qwen2ForCausalLM) if config.attention_bias else (LlamaConfig, LlamaForCausalLM)
    hcfg = cls_cfg(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                   num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                   head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
                   max_position_embeddings=config.max_position_embeddings,
                   tie_word_embeddings=config.tie_word_embeddings)
    model = cls_model(hcfg).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing)
    return model


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against(llm: LLM, model, prompt: list[int], max_tokens: int) -> list[int]:
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                              logprobs=20, prompt_logprobs=20))[0]
    ref = hf_logprobs(model, prompt + out.token_ids)
    # prompt token i is predicted at position i - 1
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == prompt[i]
        assert lp.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=TOL)
        top_vals, _ = ref[i - 1].topk(20)
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=TOL)
    # generated token j is predicted at position len(prompt) - 1 + j
    for j, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == int(row.argmax())          # greedy agrees with HF's argmax
        assert lp.logprob == pytest.approx(row.max().item(), abs=TOL)
        top_vals, _ = row.topk(20)
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_vals, atol=TOL)
    return out.token_ids


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
def test_tiny_model_matches_transformers(bias):
    config = ModelConfig(**{**TINY.__dict__, "attention_bias": bias})
    weights = random_weights(config, seed=3)
    loaded = tiny_model(config, seed=3)
    loaded = type(loaded)(config=config, weights=weights, tokenizer=None, fingerprint="t", source="random")
    model = hf_model(config, weights)
    prompt = [(i * 37) % 128 for i in range(45)]
    # chunked prefill (16-token budget) and decode steps through the paged cache
    llm = LLM(kv_format="native", loaded=loaded, block_size=8, max_num_batched_tokens=16)
    check_against(llm, model, prompt, max_tokens=10)


def test_default_model_matches_transformers_gguf_load(default_model, hf_gguf_reference):
    """Against transformers' own GGUF loader: checks our dequantization and Q/K
    un-permutation as well as the model (native weights: transformers computes with the
    dequantized float weights; the gguf format is held to them in tests/model/formats)."""
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]))
    llm = LLM(kv_format="native", loaded=default_model, max_num_batched_tokens=16, kv_cache_memory_gb=0.05, weight_format="native")
    generated = check_against(llm, hf_gguf_reference.model, prompt, max_tokens=6)
    with torch.inference_mode():
        ref = hf_gguf_reference.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                               min_new_tokens=6)
    assert generated == ref[0, len(prompt):].tolist()
