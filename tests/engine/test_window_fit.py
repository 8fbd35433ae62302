"""The pool against the context window: an engine whose KV cache cannot hold one request of
max_model_len refuses to start (``max_model_len_fit="refuse"``), naming both numbers and the
flags that fix it, or lowers max_model_len to what fits ("lower"); a pool that fits is left as
it is; unset (the Python API's default) only a request that cannot fit is refused."""

from __future__ import annotations

import logging

import pytest
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig

TO_THE_END = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)   # the rest of the window


def test_a_pool_that_cannot_hold_the_window_refuses_to_start_saying_what_to_set():
    # the tiny model's window is 512 tokens: 32 blocks of 16; the pool has 20
    with pytest.raises(ValueError) as e:
        LLM(loaded=tiny_model(), num_kv_blocks=20, max_model_len_fit="refuse")
    message = str(e.value)
    assert "20 blocks of 16 tokens" in message and "max_model_len 512 tokens needs up to 32 blocks" in message
    assert "--max-model-len 320" in message and "--num-kv-blocks 32" in message and "--kv-cache-gb" in message
    assert "--max-model-len-fit lower" in message


def test_lower_fits_the_window_to_the_pool_and_a_request_without_max_tokens_runs(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(loaded=tiny_model(), num_kv_blocks=20, max_model_len_fit="lower")
    assert llm.engine.max_model_len == 320 == llm.engine.model_card.max_model_len
    assert "max_model_len lowered from 512 to 320" in caplog.text
    out = llm.generate([random_tokens(40, 1)], TO_THE_END)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 320 - 40      # to the end of the window
    llm.engine.check_integrity()


def test_a_pool_that_fits_is_unchanged_and_unset_checks_nothing_at_start():
    assert LLM(loaded=tiny_model(), num_kv_blocks=32, max_model_len_fit="refuse").engine.max_model_len == 512
    assert LLM(loaded=tiny_model(), num_kv_blocks=40, max_model_len_fit="lower").engine.max_model_len == 512
    unset = LLM(loaded=tiny_model(), num_kv_blocks=20)          # as before: the request is what is refused
    assert unset.engine.max_model_len == 512
    with pytest.raises(ValueError, match="needs up to 32 KV blocks"):
        unset.generate([random_tokens(40, 1)], TO_THE_END)
    with pytest.raises(ValueError, match="max_model_len_fit must be one of refuse, lower"):
        EngineConfig(max_model_len_fit="shrink")
