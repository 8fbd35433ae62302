"""Gemma 3 270M (the catalog's ``gemma-3-270m``, fetched by the test setup) end to end: against
transformers' own GGUF load of the same file, and a prefix hit against a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model.test_llama_vs_hf import check_against

from kvserve import LLM, SamplingParams
from kvserve.model.gemma3 import Gemma3Model
from kvserve.model.loaded import LoadedModel
from kvserve.model.loader import load_model

CHAT = [{"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf: Path) -> LoadedModel:
    return load_model(str(gemma3_gguf))


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_gguf: Path):
    """transformers' Gemma3ForCausalLM from the same file, dequantized to float32 (~25 s)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                dtype=torch.float32).eval()


def test_config_and_tokens(gemma3: LoadedModel) -> None:
    c = gemma3.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 18, 4, 1, 256)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (640, 2048, 262144, 32768)
    full = [i for i, w in enumerate(c.sliding_windows) if w is None]
    assert full == [5, 11, 17] and set(c.sliding_windows) == {512, None}
    assert {s.rope_theta for s in c.layer_specs} == {10_000.0, 1_000_000.0}
    assert c.eos_token_ids == (1, 106) and c.bos_token_id == 2 and c.tie_word_embeddings
    prompt = gemma3.tokenizer.apply_chat_template(CHAT)
    assert prompt == ("<bos><start_of_turn>user\nAnswer in one short sentence.\n\nWhat is the capital of France?"
                      "<end_of_turn>\n<start_of_turn>model\n")
    llm_ids = gemma3.tokenizer.encode_prompt(prompt)
    assert llm_ids[:3] == [2, 105, 2364] and llm_ids.count(2) == 1          # one BOS
    assert gemma3.tokenizer.encode_prompt("Hello")[0] == 2                    # a plain prompt gets its BOS


def test_matches_transformers_gguf_load(gemma3: LoadedModel, gemma3_reference) -> None:
    """Native weights (the file's blocks dequantized, as transformers computes): every prompt and
    generated token's logprob and top 20 within 2e-4, greedy tokens equal."""
    prompt = gemma3.tokenizer.encode_prompt(gemma3.tokenizer.apply_chat_template(CHAT))
    llm = LLM(kv_format="native", loaded=gemma3, weight_format="native", max_num_batched_tokens=16, kv_cache_memory_gb=0.1)
    assert isinstance(llm.engine.model, Gemma3Model)
    check_against(llm, gemma3_reference, prompt, max_tokens=8)


def test_a_prefix_hit_gives_the_cold_tokens(gemma3: LoadedModel) -> None:
    """A second request sharing a 600-token history (past the 512-position window) computes only
    its new tokens and gives exactly the tokens it gives cold, in the file's own weights."""
    tok = gemma3.tokenizer
    history = tok.encode_prompt(" ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60)))[:600]
    question = tok.encode(" What is the number 7 squared?")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cold = LLM(loaded=gemma3, kv_cache_memory_gb=0.2).generate(history + question, params)[0]
    llm = LLM(loaded=gemma3, kv_cache_memory_gb=0.2)
    llm.generate(history + tok.encode(" Which numbers are listed?"), params)
    hit = llm.generate(history + question, params)[0]
    assert hit.num_cached_tokens == len(history) // 16 * 16
    assert hit.token_ids == cold.token_ids
