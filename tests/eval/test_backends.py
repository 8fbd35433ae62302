"""The evaluated backends on a tiny model: kvserve formats and transformers' caches."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import TINY, tiny_model

from kvserve.bench.common import hf_model_from
from kvserve.eval.backends import STORAGE_CYCLE_TOKENS, KVServeBackend
from kvserve.eval.harness import EvalSettings, Workload, evaluate
from kvserve.eval.passkey import build_cases

IDS = [(31 * i + 7) % 128 for i in range(100)]


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


@pytest.fixture(scope="module")
def hf(loaded):
    return hf_model_from(loaded, torch.float32, torch.device("cpu"))


def encode(text: str) -> list[int]:
    return [hash(w) % 128 for w in text.split(" ") if w]


def test_kvserve_bytes_per_token_come_from_the_format(loaded):
    b = KVServeBackend(loaded, "int8", 16, num_kv_blocks=16)
    cost = b.storage(100)
    per_token = 2 * 2 * 2 * (16 + 2)          # layers x K,V x heads x (int8 codes + fp16 scale)
    assert cost.bytes_per_token == per_token
    lengths = range(101, 101 + STORAGE_CYCLE_TOKENS)
    # int8 stores every token as it comes: whole blocks, no residual row
    expected = sum(-(-n // 16) * 16 * per_token / n for n in lengths) / len(lengths)
    assert cost.bytes_per_token_at_context == pytest.approx(expected)
    kivi = KVServeBackend(loaded, "kivi2g8", 16, num_kv_blocks=16).storage(100)
    per_token = 2 * 2 * (4 + 4 + 4 + 2 * 4)   # layers x heads x (K: codes + channel stats / 16; V: codes + groups)
    assert kivi.bytes_per_token == per_token
    row = 2 * 16 * 2 * 16 * 4                 # a float32 residual row of the keys of one block, both layers
    expected = sum((-(-n // 16) * 16 * per_token + (row if n % 16 else 0)) / n for n in lengths) / len(lengths)
    assert kivi.bytes_per_token_at_context == pytest.approx(expected)
    native = KVServeBackend(loaded, "native", 16, num_kv_blocks=16).storage(96)
    assert native.bytes_per_token == TINY.kv_bytes_per_token(4) == 512


def test_transformers_dense_cache_matches_native(loaded, hf):
    from kvserve.eval.hf_baseline import HFBackend, dynamic_cache_factory

    ours = KVServeBackend(loaded, "native", 16, num_kv_blocks=32)
    theirs = HFBackend(hf, dynamic_cache_factory(hf.config), "hf-dynamic", 16)
    a, b = ours.prompt_logprobs(IDS), theirs.prompt_logprobs(IDS)
    assert len(a) == len(b) == len(IDS) - 1
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert ours.greedy(IDS[:40], 12) == theirs.greedy(IDS[:40], 12)
    cost = theirs.storage(64)
    assert cost.bytes_per_token == cost.bytes_per_token_at_context == 512


@pytest.mark.parametrize("nbits", [4, 2])
def test_transformers_quantized_cache_runs_and_its_storage_is_measured(loaded, hf, nbits):
    pytest.importorskip("optimum.quanto")
    from kvserve.eval.hf_baseline import HFBackend, dynamic_cache_factory, quanto_cache_factory

    dense = HFBackend(hf, dynamic_cache_factory(hf.config), "hf-dynamic", 16)
    quant = HFBackend(hf, quanto_cache_factory(hf.config, nbits, q_group_size=16, residual_length=32),
                      f"hf-quanto{nbits}", 16)
    a, b = dense.prompt_logprobs(IDS), quant.prompt_logprobs(IDS)
    assert all(math.isfinite(x) for x in b)
    assert a[:15] == pytest.approx(b[:15], abs=1e-5)   # the first chunk attends to itself, unquantized
    assert a != pytest.approx(b, abs=1e-5)              # later chunks read quantized keys
    assert len(quant.greedy(IDS[:40], 5)) == 5
    cost = quant.storage(64)
    # per token, layer, K or V, head: 16 channels of nbits codes + float32 scale and shift
    assert cost.bytes_per_token == 2 * 2 * 2 * (16 * nbits // 8 + 8)
    assert cost.bytes_per_token < cost.bytes_per_token_at_context < 512


@pytest.mark.parametrize("fmt", ["native", "kivi2g8", "int4g8"])
def test_passkey_prefix_reuse_gives_the_cold_answers(loaded, fmt):
    cases = build_cases(encode, [96, 192], [0.0, 0.5, 1.0], seed=2, align=32)
    cases.sort(key=lambda c: -c.needle_start)
    b = KVServeBackend(loaded, fmt, 32, num_kv_blocks=64)
    cold = [b.greedy(c.token_ids, 6) for c in cases]
    assert b.llm.engine.stats().prefix_hit_tokens == 0
    warm = [b.greedy(c.token_ids, 6, shared_prefix=c.needle_start) for c in cases]
    assert warm == cold
    assert b.llm.engine.stats().prefix_hit_tokens >= sum(c.needle_start for c in cases[1:])


def test_a_misaligned_shared_prefix_is_refused(loaded):
    b = KVServeBackend(loaded, "kivi2g8", 32, num_kv_blocks=32)
    with pytest.raises(ValueError, match="multiple"):
        b.greedy(IDS, 2, shared_prefix=16)


def test_evaluate_collects_every_measurement(loaded):
    settings = EvalSettings(ppl_tokens=100, window=48, stride=24, chunk=16, num_prompts=2, agree_tokens=6,
                            passkey_lengths=(96,), passkey_depths=(0.0, 1.0), answer_tokens=4)
    work = Workload(IDS, [IDS[:20], IDS[30:45]],
                    build_cases(encode, (96,), (0.0, 1.0), align=16))
    native = KVServeBackend(loaded, "native", 16, num_kv_blocks=64)
    ref, ref_out = evaluate(native, "kvserve", work, settings, None, ("ppl", "agree", "passkey"), log=lambda m: None)
    assert ref_out is not None and ref.agreement is None
    kivi, _ = evaluate(KVServeBackend(loaded, "kivi2g8", 16, num_kv_blocks=64), "kvserve", work, settings,
                         ref_out, ("ppl", "agree", "passkey"), log=lambda m: None)
    assert kivi.ppl is not None and ref.ppl is not None and kivi.ppl.num_scored == ref.ppl.num_scored == 99
    assert kivi.agreement is not None and 0.0 <= kivi.agreement <= 1.0
    assert kivi.passkey_total is not None and kivi.passkey_total[1] == 2
    assert kivi.storage.bytes_per_token < ref.storage.bytes_per_token


@pytest.mark.parametrize("nbits", [None, 2])
def test_transformers_prefix_snapshots_give_the_cold_answers(hf, nbits):
    pytest.importorskip("optimum.quanto")
    from kvserve.eval.hf_baseline import HFBackend, dynamic_cache_factory, quanto_cache_factory

    make = (dynamic_cache_factory(hf.config) if nbits is None
            else quanto_cache_factory(hf.config, nbits, q_group_size=16, residual_length=64))
    b = HFBackend(hf, make, "hf", 32)
    cases = build_cases(encode, [96, 192], [0.0, 0.5, 1.0], seed=2, align=32)
    cases.sort(key=lambda c: -c.needle_start)
    starts = {c.needle_start for c in cases}
    cold = [b.greedy(c.token_ids, 6) for c in cases]
    warm = [b.greedy(c.token_ids, 6, c.needle_start, {p for p in starts if p <= c.needle_start}) for c in cases]
    assert warm == cold
    assert len(b._snapshots) == len(starts)          # one per needle position
