"""Decode steps through batch-size buckets (kvserve/engine/graphs.py). On CPU no graph is captured:
the buckets' static buffers and padding run eagerly, which is the step a graph records; the
capture and replay themselves are compared with the eager step on CUDA (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from model.test_gemma3 import tiny_gemma3
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.attention.backends import CpuBackend, TorchBackend
from kvserve.engine.graphs import DecodeGraphs, graph_batch_sizes, unfit_reason
from kvserve.kv.block_pool import NoFreeBlocksError

CUDA = torch.device("cuda")
PROMPTS = [random_tokens(5, seed=1), random_tokens(20, seed=2), random_tokens(37, seed=3)]
MAX_TOKENS = [4, 9, 14]     # 3 rows decode for 3 steps, 2 rows for 5, 1 row for 5


def with_buckets(llm: LLM, sizes: tuple[int, ...], max_blocks: int | None = None) -> DecodeGraphs:
    """The engine's decode steps through buckets of ``sizes`` rows, run eagerly (CPU), over
    tables of ``max_blocks`` blocks (default: max_model_len's)."""
    eng = llm.engine
    blocks = eng.kv.num_blocks_needed(eng.max_model_len) if max_blocks is None else max_blocks
    graphs = DecodeGraphs(eng.model, eng.runner.cache, eng.runner.backend, eng.kv.reserve_block(), blocks, sizes,
                          capture=False,
                          group_of_layer=eng.runner.group_of_layer)
    eng.runner.graphs = graphs
    return graphs


def generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    ids = [llm.engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    done: dict[str, list[int]] = {}
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    llm.engine.check_integrity()
    return [done[i] for i in ids]


def test_batch_sizes_are_powers_of_two_then_the_limit():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 12)
    assert graph_batch_sizes(3) == (1, 2, 3)


@pytest.mark.parametrize("kv_format", ["native", "fp16", "int8", "fp8"])
def test_padded_buckets_give_the_eager_tokens(kv_format):
    plain = generate(LLM(loaded=tiny_model(), kv_format=kv_format, attention_backend="cpu"))
    llm = LLM(loaded=tiny_model(), kv_format=kv_format, attention_backend="cpu")
    graphs = with_buckets(llm, (1, 2, 4))
    assert generate(llm) == plain
    # one prefill step eager; 3 + 5 + 5 decode steps in buckets 4, 2 and 1
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (1, 13)


def test_padding_writes_only_the_reserved_block():
    llm = LLM(loaded=tiny_model(), kv_format="native", attention_backend="cpu")
    graphs = with_buckets(llm, (4,))
    eng, bs = llm.engine, llm.engine.kv.block_size
    ids = [eng.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)) for p in PROMPTS]
    eng.step()                                              # the prefill, eager
    cache = eng.runner.cache
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    eng.step()                                              # 3 decode rows, one padding row
    assert graphs.stats.replayed_steps == 1
    # each request's 1st generated token goes to the slot after its prompt
    expected = {eng.kv.block_ids(i)[len(p) // bs] * bs + len(p) % bs for i, p in zip(ids, PROMPTS)}
    expected.add(graphs.reserved_slot)
    for old, new in zip(before, cache.key_caches + cache.value_caches):
        changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
        assert set(changed) == expected


def test_steps_that_do_not_fit_run_eagerly():
    # more rows than the largest bucket: the 3-row steps run eagerly, the 2- and 1-row ones fit
    plain = generate(LLM(loaded=tiny_model(), attention_backend="cpu"))
    llm = LLM(loaded=tiny_model(), attention_backend="cpu")
    graphs = with_buckets(llm, (1, 2))
    assert generate(llm) == plain
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (1 + 3, 10)
    # contexts past the tables' capacity (3 blocks of 16): the long request's last two steps
    # (contexts 49 and 50) run eagerly
    llm = LLM(loaded=tiny_model(), attention_backend="cpu")
    graphs = with_buckets(llm, (1, 2, 4), max_blocks=3)
    assert generate(llm) == plain
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (1 + 2, 11)
    # a format that encodes whole blocks from residual rows writes them some steps: never fits
    plain = generate(LLM(loaded=tiny_model(), kv_format="kivi2g8", attention_backend="cpu"))
    llm = LLM(loaded=tiny_model(), kv_format="kivi2g8", attention_backend="cpu")
    graphs = with_buckets(llm, (1, 2, 4))
    assert generate(llm) == plain
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (14, 0)


def test_drafted_steps_run_eagerly_with_the_plain_tokens():
    text = random_tokens(12, seed=4)
    prompt = text * 4                   # prompt lookup finds the repeat and drafts it
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(loaded=tiny_model(), attention_backend="cpu").generate([prompt], params)[0].token_ids
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    llm = LLM(loaded=tiny_model(), attention_backend="cpu", speculative_config=spec)
    llm.engine.speculator.always_draft()        # no timing decides it
    graphs = with_buckets(llm, (1, 2))
    assert llm.generate([prompt], params)[0].token_ids == plain
    stats = llm.engine.speculator.stats
    assert stats is not None and stats.num_draft_tokens > 0
    # every step with a draft ran eagerly (one request: a draft a step); the rest through the bucket
    assert graphs.stats.eager_steps == 1 + stats.num_drafts
    assert graphs.stats.replayed_steps == llm.engine.num_steps - graphs.stats.eager_steps


@pytest.mark.parametrize("kv_format", ["native", "int8"])
def test_layer_groups_each_fill_their_own_rows(kv_format):
    """Tiny Gemma 3 (five sliding layers of window 8, then a full one; blocks of 4): six groups,
    each its own tables and write slots in the bucket; contexts past the window; the eager
    engine's tokens."""
    loaded = tiny_gemma3(seed=7)[0]
    options = {"kv_format": kv_format, "attention_backend": "cpu", "block_size": 4, "num_kv_blocks": 400}
    plain = generate(LLM(loaded=loaded, **options))
    llm = LLM(loaded=loaded, **options)
    assert len(llm.engine.kv.groups) == 6
    graphs = with_buckets(llm, (1, 2, 4))
    assert generate(llm) == plain
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (1, 13)


def test_the_reserved_block_leaves_the_requests_one_block_less():
    llm = LLM(loaded=tiny_model(), attention_backend="cpu", num_kv_blocks=4, max_model_len=64)
    kv = llm.engine.kv
    assert kv.num_blocks == 4
    kv.reserve_block()
    assert kv.num_blocks == 3 and kv.num_free_blocks == 3
    kv.check_integrity()
    with pytest.raises(ValueError, match="needs up to 4 KV blocks .* but the cache has 3"):
        kv.check_fits(SamplingParams(max_tokens=32), 32, 32)
    for _ in range(3):
        kv.reserve_block()
    with pytest.raises(NoFreeBlocksError):
        kv.reserve_block()
    kv.check_integrity()


def test_cuda_graphs_are_refused_where_no_step_could_be_captured():
    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs need a CUDA device, the engine is on cpu"):
        LLM(loaded=tiny_model(), cuda_graphs=True)
    storage = LLM(loaded=tiny_model(), kv_format="kivi2g8").engine.runner.cache
    native = LLM(loaded=tiny_model()).engine.runner.cache
    assert unfit_reason(CUDA, TorchBackend(), native) == (
        "the torch attention backend builds each decode step's shapes on the host; use triton")
    assert "keeps open blocks in residual rows" in str(unfit_reason(CUDA, CpuBackend(), storage))
    assert unfit_reason(CUDA, CpuBackend(), native) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(("model", "kv_format"), [("llama", "native"), ("llama", "int8"), ("gemma3", "native")])
def test_replayed_graphs_give_the_eager_tokens_on_cuda(model, kv_format):
    loaded, block_size = (tiny_model(), 16) if model == "llama" else (tiny_gemma3(seed=7)[0], 4)
    options = {"device": "cuda", "attention_backend": "triton", "kv_format": kv_format, "max_num_seqs": 4,
               "block_size": block_size, "num_kv_blocks": 400}
    plain = generate(LLM(loaded=loaded, **options))
    llm = LLM(loaded=loaded, cuda_graphs=True, **options)
    assert generate(llm) == plain
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    assert (graphs.stats.eager_steps, graphs.stats.replayed_steps, graphs.stats.captured_buckets) == (1, 13, 3)
