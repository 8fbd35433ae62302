"""The engine under precision by saliency (``zip:`` KV formats; docs/kv_formats.md): which blocks
keep their finer copy, the kernel against the torch path, what is refused, tiers."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams

SPEC = "zip:hi=int8,lo=kivi2g8,salient=0.25"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(35)]
    return [shared + [rng.randrange(128) for _ in range(n)] for n in (1, 9, 20, 31)] + [[3, 4, 5]]


def test_the_engine_keeps_the_finer_copies_of_each_requests_most_salient_blocks(loaded):
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    e = llm.engine
    assert e.runner.backend.name == "cpu"
    prompt = _prompts()[3]
    rid = e.add_request(prompt, GREEDY)
    refined_before: set[int] = set()
    held: set[int] = set()          # dropped while the prompt's chunks ran: held aside, by block index
    num_full_before, checked, regraded = 0, 0, False
    while e.has_unfinished:
        e.step()
        state = e.kv.budgets.get(rid)
        if state is None:
            break
        table = e.kv.block_ids(rid)
        num_full = state.num_recorded // 4
        score = e.kv.budgets.block_saliency(rid, num_full)
        top = set(sorted(range(num_full), key=lambda i: (-float(score[i]), i))[:math.ceil(0.25 * num_full)])
        refined = {i for i in range(num_full) if e.kv.residual.refined.slot(table[i]) is not None}
        regrade = state.num_recorded >= len(prompt) and not regraded
        if num_full == num_full_before and not regrade:     # settled only when a block fills
            assert refined == refined_before
            continue
        had = refined_before | set(range(num_full_before, num_full))
        if regrade:
            # the whole prompt seen: the top quarter get back the copies its chunks dropped
            assert refined == (had | held) & top and refined & held
            held, regraded = set(), True
        else:
            # a block keeps its finer copy while it ranks in the top quarter; once the prompt is
            # whole, one that lost it never gets it back
            assert refined == had & top
            if state.num_recorded < len(prompt):
                held |= had - refined
        assert e.kv.budgets.held_nbytes == len(held) * e.kv.budgets.copy_nbytes
        e.check_integrity()
        refined_before, num_full_before = refined, num_full
        checked += 1
    # full blocks 4, 8, 12, 16 (prefill chunks of 16 of the 66 prompt tokens), the prompt whole
    # (its last chunk of 2 fills none), then 17, 18, 19 in decode
    assert (regraded, checked, num_full_before) == (True, 8, (66 + 12 - 1) // 4)
    assert e.kv.budgets.num_dropped > 0 and e.kv.budgets.num_restored > 0 and e.kv.budgets.held_nbytes == 0
    e.check_integrity()


def test_a_prompt_holds_no_copies_beyond_the_host_room(loaded):
    # room for one held copy (per request, all layers' key and value parts of one block)
    probe = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4)
    one = probe.engine.kv.budgets.copy_nbytes
    assert one == probe.engine.kv_format.refined_nbytes_per_block(4, 2, 16) > 0     # the tiny model: 2 heads of 16
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              kv_budget_host_gb=one / 2**30)
    b = llm.engine.kv.budgets
    assert b.host_bytes == one
    seen = 0
    rid = llm.engine.add_request(_prompts()[3], GREEDY)
    while llm.engine.has_unfinished:
        llm.engine.step()
        seen = max(seen, b.held_nbytes)
        assert b.held_nbytes <= one
    assert seen == one and b.num_unheld > 0 and b.stats().num_host_evictions == b.num_unheld
    assert b.get(rid) is None and b.held_nbytes == 0


def test_rank_recent_keeps_the_first_block_and_the_newest(loaded):
    llm = LLM(loaded=loaded, kv_format=SPEC + ",rank=recent", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    e = llm.engine
    assert e.kv_format.spec == "zip:hi=int8,lo=kivi2g8,salient=0.25,rank=recent"
    rid = e.add_request(_prompts()[3], GREEDY)
    table: list[int] = []
    while e.has_unfinished:
        table = e.kv.block_ids(rid) or table
        e.step()
    # 66 + 12 tokens: 19 full blocks when its last step settled, 5 kept (ceil(0.25 x 19))
    refined = [i for i, b in enumerate(table) if e.kv.residual.refined.slot(b) is not None]
    assert refined == [0, 15, 16, 17, 18]


@pytest.mark.parametrize("spec", [SPEC, "zip:hi=int8,lo=kivi2g8+had,salient=0.5", "zip:hi=fp16,lo=int4g8,salient=0.25"])
def test_the_cpu_kernel_gives_the_torch_paths_tokens(loaded, spec):
    # chunked prefills over cached context, decodes and a prefix hit, in one batch
    runs = []
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=loaded, kv_format=spec, num_kv_blocks=64, max_num_batched_tokens=24, attention_backend=backend)
        llm.generate(_prompts()[:1], GREEDY)
        runs.append(llm.generate(_prompts(), GREEDY))
        assert llm.engine.kv.budgets.num_dropped > 0
        llm.engine.check_integrity()
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.num_cached_tokens for o in runs[1]] == [32, 32, 32, 32, 0]


def test_what_a_zip_format_cannot_do_is_refused(loaded):
    # a budget of any policy but saliency-blocks, the engine's or a request's
    with pytest.raises(ValueError, match="KV policy 'streaming' cannot run under the KV format zip:.*one measure "
                                         "ranks both.*give kv_policy saliency-blocks"):
        LLM(loaded=loaded, kv_format=SPEC, kv_budget=64)
    with pytest.raises(ValueError, match="triton attention backend cannot read zip:hi=int8,lo=kivi2g8\\+had.*"
                                         "Hadamard domain only"):
        LLM(loaded=loaded, kv_format="zip:hi=int8,lo=kivi2g8+had,salient=0.2", attention_backend="triton")
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=32)
    for policy in ("snapkv", "saliency", "arkvale", None):      # None: the engine's (streaming)
        with pytest.raises(ValueError, match=f"KV policy '{policy or 'streaming'}' cannot run under the KV format "
                                             "zip:hi=int8,lo=kivi2g8,salient=0.25"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, kv_budget=32, kv_policy=policy))
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finished       # and nothing else is harmed
    # the engine's saliency budget runs: every request compacts under it
    engine_wide = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, kv_budget=48, kv_policy="saliency-blocks")
    out = engine_wide.generate([_long_prompt()], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 20 and engine_wide.engine.kv.budgets.num_compactions == 2
    engine_wide.engine.check_integrity()


def test_a_block_back_from_a_tier_is_read_at_its_base_precision(loaded):
    prompt = [random.Random(1).randrange(128) for _ in range(70)]
    filler = [random.Random(1000).randrange(128) for _ in range(8 * 16 - 1)]
    with LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=8, host_cache_gb=1 / 1024) as llm:
        e = llm.engine
        rid = e.add_request(prompt, GREEDY)
        e.step()
        table = e.kv.block_ids(rid)
        refined_before = [b for b in table[:4] if e.kv.residual.refined.slot(b) is not None]
        while e.has_unfinished:
            e.step()
        assert refined_before                       # its salient blocks had a finer copy
        llm.generate(filler, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        e.kv.flush_tiers()
        rid = e.add_request(prompt, GREEDY)
        e.step()
        assert e.stats().tiers[0].loaded_tokens == 64
        table = e.kv.block_ids(rid)
        # the four blocks loaded from the host tier hold their base parts alone
        assert [e.kv.residual.refined.slot(b) for b in table[:4]] == [None] * 4
        while e.has_unfinished:
            e.step()
        e.check_integrity()


def test_requests_under_a_zip_format_do_not_draft(loaded):
    # which blocks keep a finer copy follows the steps taken: drafting would change the tokens
    prompt = [[7, 3, 9, 1, 4, 2] * 6 + [5, 8] + [7, 3, 9, 1, 4, 2] * 3]
    spec = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4)
    assert spec.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids
    assert spec.engine.speculator.stats.num_drafts == 0


# -- a KV budget under a zip format: one measure for what is kept and at which precision ------
BUDGETED = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, kv_budget=48, kv_policy="saliency-blocks")


def _long_prompt() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(128) for _ in range(200)]


def _run_budgeted(llm: LLM, prompts: list[list[int]], params: SamplingParams = BUDGETED) -> list[list[int]]:
    """Generate under ``params``, checking the engine's books after every step."""
    e = llm.engine
    ids = [e.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished:
        for out in e.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        e.check_integrity()
    return [tokens[rid] for rid in ids]


@pytest.mark.parametrize("spec", [SPEC, "zip:hi=int8+had,lo=int4g8+had,salient=0.5"])
def test_a_saliency_budget_runs_under_a_zip_format_on_every_path(loaded, spec, monkeypatch):
    """Compactions under a zip format (the prompt's, then in decode), two requests in one batch:
    the cpu kernel, the torch path and the masked reference give the same tokens; every block, row
    and side slot comes back."""
    from kvserve.kv.budget.state import BudgetState

    prompts = [_long_prompt(), _long_prompt()[:150] + [9] * 30]
    got = {}
    for backend in ("torch", "cpu", "reference"):
        if backend == "reference":
            monkeypatch.setattr(BudgetState, "is_dense", property(lambda self: False))
        llm = LLM(loaded=loaded, kv_format=spec, num_kv_blocks=96, max_num_batched_tokens=64,
                  attention_backend="torch" if backend == "reference" else backend)
        got[backend] = _run_budgeted(llm, prompts)
        kv = llm.engine.kv
        assert kv.budgets.num_compactions >= 6 and kv.budgets.num_dropped > 0
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.residual.num_free_rows == kv.residual.num_rows
        # the prompts' cached blocks lost their copies when the requests left them, the compacted
        # blocks (never cached) theirs when they were freed
        assert kv.residual.refined.num_free_slots == kv.residual.refined.num_slots
    assert got["torch"] == got["cpu"] == got["reference"]
    assert all(len(t) == 40 for t in got["cpu"])


def test_a_compaction_keeps_whole_blocks_and_their_finer_copies_by_one_measure(loaded, monkeypatch):
    """Each compaction (budget 48, blocks of 16: three full blocks kept): the sink block, the last
    window's two blocks (the saliency budget's window is 24 tokens) and the most salient of the
    rest by ``block_saliency``, up to three (so here the sink and the window's), then the open
    block; the table is those blocks in order, read back as they were (nothing is written); the
    blocks that left hold no finer copy, and of the kept full blocks the ceil(0.25 x 3) = 1 most
    salient holds one."""
    from kvserve.kv.budget.precision import SaliencyPrecision

    seen = []
    kept_blocks, apply_blocks = SaliencyPrecision.kept_blocks, SaliencyPrecision.apply_blocks

    def choosing(self, request, block_ids):
        state = self.get(request.request_id)
        full = (request.num_computed_tokens - state.num_evicted) // 16
        score = self.block_saliency(request.request_id, full).tolist()
        window = list(range(full - 2, full))
        rest = sorted((i for i in range(full) if i not in window and i != 0), key=lambda i: (-score[i], i))
        want = sorted([0, *window, *rest][:3])
        before = [self.storage.gather(layer, torch.tensor([block_ids]), self.storage.open_overlay(block_ids))
                  for layer in range(self.num_layers)]
        had = {b for b in block_ids if self.storage.refined.slot(b) is not None}
        kept = kept_blocks(self, request, block_ids)
        assert kept[:3] == want and len(kept) in (3, 4)
        seen.append((list(block_ids), kept, (before, had)))
        return kept

    def applying(self, request, kept, block_ids):
        apply_blocks(self, request, kept, block_ids)
        old, _, (before, had) = seen[-1]
        refined = self.storage.refined
        assert block_ids == [old[i] for i in kept]
        assert [b for b in old if b not in block_ids and refined.slot(b) is not None] == []
        score = self.block_saliency(request.request_id, 3).tolist()
        top = max(range(3), key=lambda i: (score[i], -i))
        assert [refined.slot(b) is not None for b in block_ids[:3]] == [i == top for i in range(3)]
        n = 16 * len(kept)
        index = torch.cat([torch.arange(16 * i, 16 * i + 16) for i in kept])
        for layer in range(self.num_layers):
            k, v = self.storage.gather(layer, torch.tensor([block_ids]), self.storage.open_overlay(block_ids))
            # a kept block reads as it read before unless it lost its finer copy now (base precision)
            same = [i for i, b in enumerate(block_ids) if b not in had or refined.slot(b) is not None]
            assert len(same) >= len(kept) - 1
            for got, was in ((k[0], before[layer][0][0]), (v[0], before[layer][1][0])):
                assert got.shape[0] == n
                for i in same:
                    assert torch.equal(got[16 * i:16 * i + 16], was[index[16 * i:16 * i + 16]])

    monkeypatch.setattr(SaliencyPrecision, "kept_blocks", choosing)
    monkeypatch.setattr(SaliencyPrecision, "apply_blocks", applying)
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, max_num_batched_tokens=64)
    assert len(_run_budgeted(llm, [_long_prompt()])[0]) == 40
    # the prompt's (200 tokens: 3 full blocks and the open one's 8), then at 64 slots (after 8
    # and 24 of the 39 decode steps)
    assert len(seen) == 3 and [len(k) for _, k, _ in seen] == [4, 3, 3]


def test_saliency_budgets_under_a_zip_format_survive_preemption(loaded):
    """Four budgeted requests in a pool too small for them all: requests are preempted mid-prompt
    (their states dropped: they start again from scratch), every request finishes and compacts,
    the books hold after every step, and at the end every block is free and the only finer
    copies left are those of blocks the prefix cache still knows."""
    rng = random.Random(7)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (120, 150, 90, 130)]
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=16, max_num_batched_tokens=64, block_size=16)
    e = llm.engine
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, kv_budget=48, kv_policy="saliency-blocks")
    assert [len(t) for t in _run_budgeted(llm, prompts, params)] == [60] * 4
    assert e.scheduler.num_preemptions > 0 and e.kv.budgets.num_compactions > 0
    assert e.kv.num_free_blocks == 16
    refined = e.kv.residual.refined
    assert all(e.kv._pool.blocks[b].is_cached for b in refined.block_ids)
