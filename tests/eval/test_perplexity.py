"""Sliding-window perplexity: window arithmetic, and exact numbers on a tiny model."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from tiny import tiny_model

from kvserve.bench.common import hf_model_from
from kvserve.eval.backends import KVServeBackend
from kvserve.eval.perplexity import Window, halves_windows, perplexity, sliding_windows


@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (10, 4, 2), (11, 4, 3), (100, 32, 16), (100, 200, 50),
                                             (64, 16, 15), (1000, 64, 1)])
def test_every_token_but_the_first_is_scored_once(n, window, stride):
    windows = sliding_windows(n, window, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert scored == list(range(1, n))
    assert windows[-1].end == n
    assert all(w.end - w.begin <= window for w in windows)
    for prev, w in itertools.pairwise(windows):
        assert w.begin == prev.begin + stride
        assert w.score_from - w.begin == window - stride    # the overlap is context, never scored twice


def test_windows_by_hand():
    assert sliding_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert sliding_windows(5, 8, 4) == [Window(0, 5, 1)]


@pytest.mark.parametrize("n,window,stride", [(1, 4, 2), (10, 1, 1), (10, 4, 4), (10, 4, 0)])
def test_bad_windows_are_rejected(n, window, stride):
    with pytest.raises(ValueError):
        sliding_windows(n, window, stride)


def test_halves_are_llama_perplexity_chunks():
    """llama.cpp's llama-perplexity: whole windows back to back, the tokens after the first
    half scored (logits of positions W/2 .. W-2 predict W/2+1 .. W-1); the rest of the text left out."""
    assert halves_windows(10, 4) == [Window(0, 4, 3), Window(4, 8, 7)]
    assert halves_windows(2048, 1024) == [Window(0, 1024, 513), Window(1024, 2048, 1537)]
    with pytest.raises(ValueError, match="one whole window"):
        halves_windows(1000, 1024)

    def score(ids):
        return [-float(i) for i in range(1, len(ids))]

    result = perplexity(score, list(range(10)), window=4, stride=2, layout="halves")
    assert result.num_scored == 2 and result.nll_sum == pytest.approx(3 + 3)   # position 3 of each window
    with pytest.raises(ValueError, match="layout"):
        perplexity(score, list(range(10)), window=4, stride=2, layout="chunks")


def test_perplexity_keeps_only_the_scored_tokens():
    # the scorer gives token i (within its window) logprob -(position in window); only the
    # tokens past the overlap count, so each window contributes its last tokens only
    def score(ids):
        return [-float(i) for i in range(1, len(ids))]

    result = perplexity(score, list(range(10)), window=4, stride=2)
    # window [0,4): tokens 1,2,3 at positions 1,2,3; later windows: the last two positions (2, 3)
    assert result.num_scored == 9
    assert result.nll_sum == pytest.approx(1 + 2 + 3 + 3 * (2 + 3))
    assert result.perplexity == pytest.approx(math.exp(result.nll_sum / 9))


def test_a_constant_scorer_gives_its_perplexity():
    result = perplexity(lambda ids: [-math.log(7.0)] * (len(ids) - 1), list(range(50)), window=16, stride=8)
    assert result.perplexity == pytest.approx(7.0)


def test_a_scorer_of_the_wrong_length_is_an_error():
    with pytest.raises(RuntimeError, match="logprobs"):
        perplexity(lambda ids: [0.0], list(range(10)), window=4, stride=2)


def _reference_nll(model, ids: list[int], window: int, stride: int) -> list[float]:
    """-log p of tokens 1..n-1 from full forwards of each window (no cache, no chunks)."""
    nll = []
    for w in sliding_windows(len(ids), window, stride):
        with torch.inference_mode():
            logits = model(torch.tensor([ids[w.begin:w.end]])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for t in range(w.score_from, w.end):
            nll.append(-logprobs[t - w.begin - 1, ids[t]].item())
    return nll


@pytest.mark.parametrize("chunk", [16, 48, 512])
def test_native_perplexity_equals_exp_mean_nll_from_model_logits(chunk):
    loaded = tiny_model()
    ids = [(17 * i + 3) % 128 for i in range(150)]
    nll = _reference_nll(hf_model_from(loaded, torch.float32, torch.device("cpu")), ids, 64, 32)
    backend = KVServeBackend(loaded, "native", chunk, num_kv_blocks=32)
    result = perplexity(backend.prompt_logprobs, ids, 64, 32)
    assert result.num_scored == len(nll) == 149
    assert result.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


def test_a_quantized_format_changes_the_perplexity_a_little():
    loaded = tiny_model()
    ids = [(17 * i + 3) % 128 for i in range(150)]
    native = perplexity(KVServeBackend(loaded, "native", 16, num_kv_blocks=32).prompt_logprobs, ids, 64, 32)
    kivi2 = perplexity(KVServeBackend(loaded, "kivi2g8", 16, num_kv_blocks=32).prompt_logprobs, ids, 64, 32)
    int8 = perplexity(KVServeBackend(loaded, "int8", 16, num_kv_blocks=32).prompt_logprobs, ids, 64, 32)
    assert kivi2.perplexity != native.perplexity
    assert abs(int8.perplexity / native.perplexity - 1) < abs(kivi2.perplexity / native.perplexity - 1)
    assert abs(int8.perplexity / native.perplexity - 1) < 0.01


def test_a_stride_is_refused_with_the_halves_layout():
    """--stride acts on sliding windows only: given with halves it is refused, not ignored."""
    import argparse

    from kvserve.eval.cli import ppl_stride
    from kvserve.eval.perplexity import describe_layout

    with pytest.raises(SystemExit, match="no stride"):
        ppl_stride(argparse.Namespace(ppl_layout="halves", stride=256))
    assert ppl_stride(argparse.Namespace(ppl_layout="sliding", stride=256)) == 256
    assert ppl_stride(argparse.Namespace(ppl_layout="sliding", stride=None)) == 512
    assert describe_layout("sliding", 1024, 512) == "window 1024, stride 512"
    assert "second half" in describe_layout("halves", 1024, 512)
