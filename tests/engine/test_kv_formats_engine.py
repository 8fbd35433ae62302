"""The engine under quantized KV formats (tiny model: head_dim 16, so groups of 8)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.kv.storage.quantized import QuantizedKVCache

FORMATS = ["fp16", "bf16", "fp8", "int8", "int4g8", "kivi4g8", "kivi2g8", "int8+had", "int4g8+out2",
           "0=fp16;1-=kivi2g8", "k=int8,v=int4g8"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(35)]
    return [shared + [rng.randrange(128) for _ in range(n)] for n in (1, 9, 20, 31)] + [[3, 4, 5]]


BACKENDS = ["torch", "cpu"]     # the reference and the in-place kernel (tests/attention for triton)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_hit_gives_the_tokens_of_a_cold_run_in_the_same_format(loaded, fmt, backend):
    cold = LLM(loaded=loaded, kv_format=fmt, enable_prefix_caching=False, num_kv_blocks=64, attention_backend=backend)
    warm = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=64, attention_backend=backend)
    ref = cold.generate(prompts(), GREEDY)
    warm.generate(prompts()[:2], GREEDY)
    got = warm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in got] == [32, 32, 32, 32, 0]   # the shared 35 tokens: 2 blocks
    warm.engine.check_integrity()
    assert warm.engine.kv.residual.num_free_rows == warm.engine.kv.residual.num_rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_under_a_quantized_format_keeps_the_tokens(loaded, backend):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = LLM(loaded=loaded, kv_format="kivi2g8", enable_prefix_caching=False, attention_backend=backend)
    small = LLM(loaded=loaded, kv_format="kivi2g8", num_kv_blocks=12, enable_prefix_caching=False,
                max_num_batched_tokens=64, attention_backend=backend)
    assert ([o.token_ids for o in small.generate(prompts(1), params)]
            == [o.token_ids for o in big.generate(prompts(1), params)])
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check_integrity()


@pytest.mark.parametrize("fmt", ["native", *FORMATS])
def test_the_cpu_kernel_gives_the_torch_paths_tokens(loaded, fmt):
    # chunked prefills over cached context, decodes and a prefix hit, in one batch
    torch_path = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=64, max_num_batched_tokens=24,
                     attention_backend="torch")
    kernel = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=64, max_num_batched_tokens=24, attention_backend="cpu")
    assert kernel.engine.runner.backend.name == "cpu" and kernel.engine.runner.backend.reads_in_place
    for llm in (torch_path, kernel):
        llm.generate(prompts()[:1], GREEDY)
    got, ref = kernel.generate(prompts(), GREEDY), torch_path.generate(prompts(), GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in ref]
    kernel.engine.check_integrity()


@pytest.mark.parametrize("fmt", ["kivi2g8", "int4g8+out2", "int8"])
def test_the_kernel_gives_the_same_bits_however_the_budget_cuts_the_prompt(loaded, fmt):
    """A query before its block's last slot reads a whole-block half (KIVI's keys, +outN) encoded
    when its step fills the block, else the block's full-precision residual row; chunks that stop
    short of the prompt's end end on block boundaries, so the answer is the same to the bit under
    any budget (6, 12, 16 and 64 tokens; blocks of 4)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = [LLM(loaded=loaded, kv_format=fmt, enable_prefix_caching=False, num_kv_blocks=256, block_size=4,
                attention_backend="cpu", max_num_batched_tokens=budget).generate(prompts()[:4], params)
            for budget in (6, 12, 16, 64)]
    first = [[(lp.token_id, lp.logprob) for lp in o.logprobs] for o in runs[0]]
    for run in runs[1:]:
        assert [[(lp.token_id, lp.logprob) for lp in o.logprobs] for o in run] == first


def test_an_aborted_request_under_the_kernel_leaves_nothing_behind(loaded):
    llm = LLM(loaded=loaded, kv_format="kivi2g8", num_kv_blocks=64, attention_backend="cpu")
    e = llm.engine
    rids = [e.add_request(p, GREEDY) for p in prompts()]
    for _ in range(3):
        e.step()
    e.abort(rids[1])
    e.abort(rids[3])
    while e.has_unfinished:
        e.step()
        e.check_integrity()
    assert e.kv.residual.num_free_rows == e.kv.residual.num_rows
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_formats_never_share_block_keys(loaded):
    keys = {}
    for fmt in ["native", "fp16", "int8", "kivi2g8", "kivi4g8"]:
        llm = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=8)
        keys[llm.engine.kv_format.spec] = llm.engine.kv.extra_key
    assert len(set(keys.values())) == len(keys) == 5


def test_the_default_on_cpu_is_fp16_kv_auto(loaded):
    """kv_format defaults to auto: fp16 over the CPU's float32 compute (docs/kv_formats.md), the
    same format, bytes and block keys as asking for fp16; native keeps float32."""
    default, fp16, native = (LLM(loaded=loaded, num_kv_blocks=8, **kw) for kw in ({}, {"kv_format": "fp16"},
                                                                                  {"kv_format": "native"}))
    assert default.engine.dtype == torch.float32
    assert default.engine.kv_format.spec == fp16.engine.kv_format.spec == "fp16"
    assert default.engine.kv.extra_key == fp16.engine.kv.extra_key != native.engine.kv.extra_key
    # tiny: 2 layers, 2 KV heads, head_dim 16, block 16, K and V
    assert default.engine.runner.cache.nbytes == 8 * 2 * 2 * 2 * 16 * 16 * 2
    assert native.engine.runner.cache.nbytes == 2 * default.engine.runner.cache.nbytes
    prompt = prompts(3)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert default.generate([prompt], params)[0].token_ids == fp16.generate([prompt], params)[0].token_ids


def test_cache_bytes_follow_the_format(loaded):
    # tiny: 2 layers, 2 KV heads, head_dim 16, block 16: int8 = 2 * 2 * 2 * 16 * (16 + 2) bytes a block;
    # int8 stores each token as it comes, so it keeps no residual rows
    llm = LLM(loaded=loaded, kv_format="int8", num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=32)
    cache = llm.engine.runner.cache
    assert isinstance(cache, QuantizedKVCache)
    assert cache.nbytes == 10 * 2 * 2 * 2 * 16 * (16 + 2)
    # kivi2g8: keys per channel over a block (16 * 4 + 16 * 4 bytes a block and head), values per token
    # (16 * (4 + 2 groups * 4)); the residual rows hold the keys of open blocks only (2 layers, fp32)
    llm = LLM(loaded=loaded, kv_format="kivi2g8", num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=32)
    rows = 32 // 16 + 2 * 4 + 1
    per_block = 2 * 2 * (16 * 4 + 16 * 4 + 16 * (4 + 2 * 4))
    reserved = rows * 2 * 16 * 2 * 16 * 4
    assert llm.engine.runner.cache.nbytes == 10 * per_block + reserved
    # sized from memory: the residual rows are reserved first
    llm = LLM(loaded=loaded, kv_format="kivi2g8", kv_cache_memory_gb=(reserved + 100 * per_block) / 2**30,
              max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.engine.kv.num_blocks == 100


def test_quantized_storage_is_really_used(loaded):
    llm = LLM(loaded=loaded, kv_format="int8", num_kv_blocks=8)
    llm.generate(list(range(40)), SamplingParams(max_tokens=1))
    parts = llm.engine.runner.cache.key_parts[0]
    codes = next(t for t in parts.values() if t.dtype == torch.int8)
    assert codes[:2].abs().sum() > 0          # the two full blocks were encoded
    assert codes[2, :8].abs().sum() > 0       # the open third block holds its 8 tokens, encoded as they came
    assert codes[2, 8:].abs().sum() == 0 and codes[3:].abs().sum() == 0
    kivi = LLM(loaded=loaded, kv_format="kivi2g8", num_kv_blocks=8)
    kivi.generate(list(range(40)), SamplingParams(max_tokens=1))
    cache = kivi.engine.runner.cache
    assert cache.key_parts[0]["codes"][2].sum() == 0       # the open block's keys live in a residual row
    assert cache.value_parts[0]["codes"][2, :8].sum() > 0  # its values are in the block already


def test_residual_rows_that_do_not_fit_are_a_clear_error(loaded):
    with pytest.raises(ValueError, match="lower max_num_seqs"):
        LLM(loaded=loaded, kv_format="kivi2g8", kv_cache_memory_gb=1e-4)


def test_bad_format_is_a_clear_error(loaded):
    with pytest.raises(ValueError, match="unknown KV format 'int3'"):
        LLM(loaded=loaded, kv_format="int3")
    with pytest.raises(ValueError, match="does not divide head_dim 16"):
        LLM(loaded=loaded, kv_format="int4g32")
