"""KV budgets in the engine, on the tiny random model: exact kept counts, released
blocks, untouched shared prefixes, no change when the budget covers the context."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.kv.budget.arkvale import ArkValeState
from kvserve.kv.budget.policies import POLICIES

BLOCK = 16


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def greedy(max_tokens: int, **budget) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **budget)


def used_blocks(llm: LLM) -> int:
    return sum(1 for b in llm.engine.kv._pool.blocks if b.ref_count > 0)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_budget_covering_the_context_gives_the_unbudgeted_tokens(loaded, policy):
    prompt = tokens(150)
    ref = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64).generate(prompt, greedy(40))[0].token_ids
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64)
    out = llm.generate(prompt, greedy(40, kv_budget=192, kv_policy=policy))[0]
    assert out.token_ids == ref
    assert llm.engine.kv.budgets.num_compactions == 0


def run_prefill(llm: LLM, prompt: list[int], params: SamplingParams) -> str:
    """Step until the prompt is computed (and compacted); return the request id."""
    rid = llm.engine.add_request(prompt, params)
    req = llm.engine.tokens.requests[rid]
    while req.num_computed_tokens < len(prompt):
        llm.engine.step()
    return rid


EXPECTED_KEPT = {"streaming": [64, 64], "h2o": [64, 64], "snapkv": [64, 64], "pyramid": [96, 32],
                 "merge": [64, 64], "saliency": [64, 64], "saliency-blocks": [64 + 150 % BLOCK] * 2,
                 "arkvale": [64 + 150 % BLOCK] * 2, "arkvale-bound": [64 + 150 % BLOCK] * 2}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_each_policy_keeps_exactly_its_budget_per_layer_and_frees_blocks(loaded, policy):
    prompt = tokens(150)
    full = LLM(kv_format="native", loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=False)
    run_prefill(full, prompt, greedy(20))
    assert used_blocks(full) == 10           # 150 tokens
    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=False)
    rid = run_prefill(llm, prompt, greedy(20, kv_budget=64, kv_policy=policy))
    state = llm.engine.kv.budgets.get(rid)
    assert state is not None and state.is_compacted
    num_slots = llm.engine.kv.num_slots(llm.engine.tokens.requests[rid])
    kept = [state.num_kept(layer, num_slots) for layer in range(2)]
    assert kept == EXPECTED_KEPT[policy]
    assert num_slots == max(kept)
    assert used_blocks(llm) == len(llm.engine.kv.block_ids(rid)) == -(-max(kept) // BLOCK)
    assert state.num_evicted == 150 - num_slots
    if policy == "streaming":
        assert state.pos[0][:, :64].tolist() == [[0, 1, 2, 3, *range(90, 150)]] * 2
    if policy == "saliency-blocks":
        # whole blocks in every layer and head: the first, one more, the window's two (blocks 7 and
        # 8) and the open block's 6 tokens
        third = state.pos[0][0, 16]
        assert int(third) % BLOCK == 0 and 16 <= int(third) <= 96
        want = [*range(16), *range(int(third), int(third) + 16), *range(112, 150)]
        assert all(state.pos[layer][:, :70].tolist() == [want] * 2 for layer in range(2))
    if policy.startswith("arkvale"):
        assert isinstance(state, ArkValeState)
        assert [len(r) for r in state.resident] == [4, 4] and [len(h) for h in state.host] == [5, 5]
        assert llm.engine.kv.budgets.host_nbytes == 2 * 5 * 2 * BLOCK * 2 * 16 * 4
    # decode: the budget holds, compacting whenever a whole block can be freed
    while llm.engine.has_unfinished:
        llm.engine.step()
        req = llm.engine.tokens.requests.get(rid)
        if req is not None:
            assert llm.engine.kv.num_slots(req) < max(EXPECTED_KEPT[policy]) + BLOCK
        llm.engine.check_integrity()
    assert used_blocks(llm) == 0


def test_decode_compacts_a_block_at_a_time_and_kv_usage_follows(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=False)
    rid = llm.engine.add_request(tokens(40), greedy(60, kv_budget=32, kv_policy="h2o"))
    req = llm.engine.tokens.requests[rid]
    seen = []
    while llm.engine.has_unfinished:
        llm.engine.step()
        if rid in llm.engine.tokens.requests:
            seen.append((req.num_computed_tokens, llm.engine.kv.num_slots(req), used_blocks(llm)))
    # prefill: 40 tokens > 32 + 16? no: 40 - 32 < 16, so nothing is evicted yet
    assert seen[0] == (40, 40, 3)
    # the first compaction when the slots reach budget + a block (48), then every 16 tokens
    assert (48, 32, 2) in seen and (64, 32, 2) in seen and (47, 47, 3) in seen
    assert max(s for _, s, _ in seen) == 47
    assert llm.engine.kv.budgets.num_compactions == 4      # at 48, 64, 80, 96 (99 tokens computed)


def test_shared_prefix_blocks_are_never_altered_for_other_requests(loaded):
    system = tokens(64, seed=1)
    a = system + tokens(100, seed=2)
    b = system + tokens(20, seed=3)
    c = system + tokens(30, seed=4)
    ref = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64)
    ref_b = ref.generate(b, greedy(30))[0].token_ids
    ref_c = ref.generate(c, greedy(30))[0].token_ids

    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64)
    e = llm.engine
    rid_a = e.add_request(a, greedy(30, kv_budget=32, kv_policy="snapkv"))
    e.step()                                     # a: the system prompt (4 blocks, now cached)
    shared = e.kv.block_ids(rid_a)[:4]
    rid_b = e.add_request(b, greedy(30))
    outs: dict[str, list[int]] = {}
    while e.has_unfinished:
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
                assert o.request_id != rid_b or o.num_cached_tokens == 64
        if rid_a in e.tokens.requests and e.kv.budgets.get(rid_a).is_compacted:
            # a copied the shared blocks before compacting; b still holds the originals
            assert not set(e.kv.block_ids(rid_a)) & set(shared)
            if rid_b in e.tokens.requests:
                assert e.kv.block_ids(rid_b)[:4] == shared
        e.check_integrity()
    assert outs[rid_b] == ref_b
    assert all(e.kv._pool.blocks[i].is_cached for i in shared)
    out_c = llm.generate(c, greedy(30))[0]
    assert out_c.num_cached_tokens == 64 and out_c.token_ids == ref_c


def test_compaction_writes_fresh_blocks_and_cached_ones_stay_hits(loaded):
    prompt = tokens(100)
    ref = LLM(loaded=loaded, num_kv_blocks=64).generate(prompt, greedy(4))[0].token_ids
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64)
    e = llm.engine
    rid = e.add_request(prompt, greedy(4, kv_budget=32, kv_policy="snapkv"))
    e.step()                                         # 64 tokens: 4 full blocks, cached
    table = e.kv.block_ids(rid)
    assert all(e.kv._pool.blocks[i].is_cached for i in table[:4])
    e.step()                                         # the rest of the prompt, then the compaction
    head = e.kv.block_ids(rid)
    assert len(head) == 2 and not set(head) & set(table)
    assert not any(e.kv._pool.blocks[i].is_cached for i in head)        # rewritten blocks have no key
    assert all(b.is_cached for b in e.kv._pool.blocks[:6])               # the computed ones keep theirs
    while e.has_unfinished:
        e.step()
        assert not any(e.kv._pool.blocks[i].is_cached for i in e.kv.block_ids(rid))
    again = llm.generate(prompt, greedy(4))[0]
    assert again.num_cached_tokens == 96 and again.token_ids == ref
    e.check_integrity()


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_a_budgeted_request_with_prefix_hits_selects_over_its_whole_context(loaded, policy):
    prompt = tokens(150)
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64)
    llm.generate(prompt[:120], greedy(1))                 # 7 full blocks cached
    rid = run_prefill(llm, prompt, greedy(20, kv_budget=64, kv_policy=policy))
    req = llm.engine.tokens.requests[rid]
    assert req.num_cached_tokens == 112
    state = llm.engine.kv.budgets.get(rid)
    # the hits count as context: 64 kept of 150, positions from the whole prompt
    assert [state.num_kept(layer, 64) for layer in range(2)] == [64, 64]
    assert int(state.pos[0][:, :32].min()) < 112
    assert state.pos[0][:, 32:64].tolist() == [list(range(118, 150))] * 2


def test_preemption_under_budgets_keeps_the_pool_consistent(loaded):
    prompts = [tokens(90, seed=s) for s in range(4)]
    small = LLM(loaded=loaded, num_kv_blocks=14, max_num_batched_tokens=64, kv_budget=32, kv_policy="h2o")
    outs = small.generate(prompts, greedy(30))
    assert [len(o.token_ids) for o in outs] == [30] * 4
    small.engine.check_integrity()
    assert used_blocks(small) == 0


def test_engine_default_budget_and_per_request_override(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, kv_budget=32, kv_policy="streaming",
              enable_prefix_caching=False)
    rid = run_prefill(llm, tokens(100), greedy(5))
    assert llm.engine.kv.budgets.get(rid).policy.name == "streaming"
    rid2 = run_prefill(llm, tokens(100), greedy(5, kv_budget=48, kv_policy="h2o"))
    state = llm.engine.kv.budgets.get(rid2)
    assert state.policy.name == "h2o" and state.budget == 48


def test_bad_budget_input_raises_and_leaves_the_engine_untouched(loaded):
    with pytest.raises(ValueError, match="kv_budget must be a positive"):
        SamplingParams(kv_budget=0)
    with pytest.raises(ValueError, match="unknown KV budget policy"):
        LLM(loaded=loaded, num_kv_blocks=64, kv_budget=64, kv_policy="lru")
    with pytest.raises(ValueError, match="below the minimum of 32 tokens"):
        LLM(loaded=loaded, num_kv_blocks=64, kv_budget=16)
    llm = LLM(loaded=loaded, num_kv_blocks=64)
    for params, message in [(SamplingParams(kv_budget=64, kv_policy="lru"), "unknown KV budget policy 'lru'"),
                            (greedy(4, kv_budget=31), "below the minimum"),
                            (greedy(4, kv_budget=40, kv_policy="arkvale"), "multiple of the block size"),
                            (greedy(4, kv_policy="h2o"), "needs a kv_budget")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([tokens(20), tokens(30)], [greedy(4), params])
        assert not llm.engine.has_unfinished and not llm.engine.tokens.requests


def arkvale_engine(loaded, budget_host_bytes: int = 4 << 30, num_blocks: int = 64,
                   kv_format: str = "native") -> LLMEngine:
    cache = CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False, kv_budget=64, kv_policy="arkvale",
                        budget_host_bytes=budget_host_bytes, kv_format=kv_format)
    return LLMEngine(EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded)


def test_stashed_blocks_leave_the_host_store_with_their_request(loaded):
    e = arkvale_engine(loaded)
    store = e.kv.budgets.host_store
    done = e.add_request(tokens(150), greedy(4))
    aborted = e.add_request(tokens(150, seed=1), greedy(40))
    while done in e.tokens.requests:
        e.step()
        e.check_integrity()
    assert store.owners() == {aborted} and store.nbytes == 2 * 5 * 2 * BLOCK * 2 * 16 * 4
    e.abort(aborted)
    assert store.num_blocks == 0 and store.nbytes == 0
    e.check_integrity()


def test_a_preempted_request_leaves_the_host_store(loaded):
    """A request without a budget grows until it preempts the newer arkvale request, whose
    stash goes with it (it restarts from scratch)."""
    cache = CacheConfig(num_blocks=14, enable_prefix_caching=False)
    e = LLMEngine(EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded)
    e.add_request(tokens(20, seed=5), greedy(200))
    rid = e.add_request(tokens(100), greedy(200, kv_budget=64, kv_policy="arkvale"))
    req = e.tokens.requests[rid]
    num_preempted_with_stash = 0
    while e.has_unfinished:
        stashed, preemptions = e.kv.budgets.host_store.nbytes_of(rid), req.num_preemptions
        e.step()
        if req.num_preemptions > preemptions:
            num_preempted_with_stash += stashed > 0
            assert e.kv.budgets.host_store.nbytes_of(rid) == 0
        e.check_integrity()        # no stashed block of a request without a budget state
    assert num_preempted_with_stash >= 1 and e.kv.budgets.host_store.num_blocks == 0


def test_a_small_host_store_evicts_stashed_blocks_and_counts_them(loaded):
    block_nbytes = BLOCK * 2 * 16 * 4 * 2              # K and V of one block and layer, float32
    prompt = tokens(150)
    ref = arkvale_engine(loaded)
    small = arkvale_engine(loaded, budget_host_bytes=4 * block_nbytes)
    for e in (ref, small):
        rid = e.add_request(prompt, greedy(20))
        while e.tokens.requests[rid].num_computed_tokens < len(prompt):
            e.step()
    # 5 blocks of each of 2 layers went to the host; the small store kept the newest 4
    assert ref.kv.budgets.stats().num_host_evictions == 0 and ref.kv.budgets.host_nbytes == 10 * block_nbytes
    stats = small.kv.budgets.stats()
    assert stats.num_host_evictions == 6 and stats.host_nbytes == 4 * block_nbytes
    assert stats.host_capacity_bytes == 4 * block_nbytes
    assert small.stats().budgets == stats            # what /metrics reads
    from kvserve.server.metrics import ServerMetrics
    metrics = ServerMetrics()
    metrics.on_step(small.stats(), [], 0.0)
    text = metrics.render().decode()
    assert "kvserve_kv_budget_host_evicted_blocks_total 6.0" in text
    assert f"kvserve_kv_budget_host_bytes {4 * block_nbytes}.0" in text
    while small.has_unfinished:
        outs = small.step()
        small.check_integrity()
    assert len(outs[0].token_ids) == 20 and small.kv.budgets.host_store.num_blocks == 0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_compacted_requests_attend_through_the_backends_as_the_masked_reference(loaded, policy, monkeypatch):
    """A compacted request whose layers keep equal counts (every policy but pyramid) is a plain
    sequence of slots: the cpu kernel and the torch path read it in place. Pyramid's smaller layer
    leaves a hole of whole blocks, which the cpu kernel's table for that layer skips (the torch
    path masks it). Both give the tokens of the masked reference (each layer's valid slots
    gathered and masked)."""
    from kvserve.attention.backends import CpuBackend
    from kvserve.kv.budget.state import BudgetState

    prompt = tokens(200, seed=5)
    params = greedy(60, kv_budget=64, kv_policy=policy)
    got = {}
    kernel_lens: list[list[int]] = []        # the context lengths of each cpu kernel call
    attend = CpuBackend.attend

    def recording_attend(self, q, key, value, batch, scale, out=None, scores=None):
        kernel_lens.append(batch.context_lens.tolist())
        return attend(self, q, key, value, batch, scale, out, scores)

    monkeypatch.setattr(CpuBackend, "attend", recording_attend)
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, attention_backend=backend)
        rid = run_prefill(llm, prompt, params)
        state = llm.engine.kv.budgets._states[rid]
        assert state.num_compactions > 0 and state.is_dense == (policy != "pyramid")
        if policy == "pyramid":    # layers keep 96 and 32 slots: layer 1 holds none in slot blocks 2-5
            assert state.block_holes == ((6, 6), (2, 6))
        num_slots = llm.engine.tokens.requests[rid].num_computed_tokens - state.num_evicted
        if state.is_dense:      # no slot is masked in any layer
            assert all(bool(state.key_mask(layer, num_slots).all()) for layer in range(len(state.layer_budgets)))
        kernel_lens.clear()
        while llm.engine.has_unfinished:
            for out in llm.engine.step():
                if out.finished:
                    got[backend] = out.token_ids
            llm.engine.check_integrity()
    # every decode step read in place: one kernel call per layer, layer 1 four blocks shorter for pyramid
    assert len(kernel_lens) == 2 * 60 - 2 and all(len(lens) == 1 for lens in kernel_lens)
    skipped = {a[0] - b[0] for a, b in zip(kernel_lens[::2], kernel_lens[1::2])}
    assert skipped == ({64} if policy == "pyramid" else {0})
    monkeypatch.setattr(BudgetState, "is_dense", property(lambda self: False))    # every slot masked by hand
    monkeypatch.setattr(BudgetState, "block_holes", property(lambda self: None))
    reference = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64,
                    attention_backend="torch").generate(prompt, params)[0].token_ids
    assert got["torch"] == got["cpu"] == reference


def test_requests_with_holes_share_a_step_with_others_as_alone_on_the_torch_path(loaded):
    """Two pyramid requests with different holes, a snapkv one and an unbudgeted one decode in the
    same steps through the cpu kernel (per-layer tables for the pyramid rows only), each giving
    the tokens it gives alone on the torch path."""
    runs = [(tokens(200, seed=11), greedy(40, kv_budget=64, kv_policy="pyramid")),
            (tokens(230, seed=12), greedy(40, kv_budget=32, kv_policy="pyramid")),
            (tokens(180, seed=13), greedy(40, kv_budget=48, kv_policy="snapkv")),
            (tokens(90, seed=14), greedy(40))]
    alone = [LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, attention_backend="torch")
             .generate(p, params)[0].token_ids for p, params in runs]
    llm = LLM(loaded=loaded, num_kv_blocks=128, max_num_batched_tokens=512, attention_backend="cpu")
    ids = [llm.engine.add_request(p, params) for p, params in runs]
    holes = set()
    got: dict[str, list[int]] = {}
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        for rid in ids[:2]:
            state = llm.engine.kv.budgets.get(rid)
            if state is not None and state.is_compacted:
                holes.add(state.block_holes)
        llm.engine.check_integrity()
    assert holes == {((6, 6), (2, 6)), ((3, 3), (1, 3))}       # budgets [96, 32] and [48, 16]
    assert [got[rid] for rid in ids] == alone


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "pyramid", "merge", "saliency"])
def test_the_kernels_attention_weights_are_the_torch_paths(loaded, policy, monkeypatch):
    """Decode steps of a scoring policy take their weights from the cpu kernel as it attends
    (``AttentionScores``): the same scores, compactions and tokens as scoring on the torch path
    (pyramid's: past its smaller layer's hole, which the kernel's table skips)."""
    from kvserve.attention.backends import CpuBackend

    prompt = tokens(200, seed=9)
    params = greedy(60, kv_budget=64, kv_policy=policy)

    def run(kernel_scores: bool) -> tuple[list[int], list[torch.Tensor]]:
        monkeypatch.setattr(CpuBackend, "scores_attention", kernel_scores)
        llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=64, attention_backend="cpu")
        rid = llm.engine.add_request(prompt, params)
        out: list[int] = []
        snapshot: list[torch.Tensor] = []
        while llm.engine.has_unfinished:
            for o in llm.engine.step():
                out = o.token_ids
            state = llm.engine.kv.budgets._states.get(rid)
            if state is not None and state.score is not None:     # the last step's scores before it ends
                snapshot = [s.clone() for s in state.score]
        return out, snapshot

    (kernel_tokens, kernel_scores), (torch_tokens, torch_scores) = run(True), run(False)
    assert kernel_tokens == torch_tokens and len(kernel_tokens) == 60
    for a, b in zip(kernel_scores, torch_scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_budget_in_bfloat16_scores_on_the_torch_path(loaded):
    """The kernel scores float32 queries: another compute dtype scores on the torch path (a
    budgeted bfloat16 request runs to its length, as the float32 one does)."""
    prompt = tokens(150, seed=2)
    params = greedy(10, kv_budget=64, kv_policy="h2o")
    out = LLM(loaded=loaded, num_kv_blocks=64, dtype="bfloat16", attention_backend="cpu").generate(prompt, params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


@pytest.mark.parametrize("policy", ["arkvale-m0", "arkvale-m0.1", "arkvale"])
def test_arkvale_blocks_keep_their_keys_and_values_wherever_they_move(loaded, policy, monkeypatch):
    """Through the first compaction (every block placed), the later ones (only the blocks filled
    since move, into the slots of the ones that leave) and recalls at each decode step, every
    resident slot block holds exactly the keys and values the model wrote for its block, the
    host store holds the others', and the tail and the recorded positions follow."""
    e = arkvale_engine(loaded)
    storage = e.kv.budgets.storage
    written: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    write = storage.write

    def recording_write(layer, key, value, writes):
        written.append((layer, key.clone(), value.clone()))
        return write(layer, key, value, writes)

    monkeypatch.setattr(storage, "write", recording_write)
    truth_k = torch.zeros(2, 400, 2, 16)
    truth_v = torch.zeros(2, 400, 2, 16)
    rid = e.add_request(tokens(150), greedy(200, kv_budget=64, kv_policy=policy))
    req = e.tokens.requests[rid]
    num_checked = 0
    while rid in e.tokens.requests:
        before = req.num_computed_tokens
        written.clear()
        e.step()
        for layer, k, v in written:
            truth_k[layer, before:before + k.shape[0]] = k
            truth_v[layer, before:before + k.shape[0]] = v
        state = e.kv.budgets.get(rid)
        if rid not in e.tokens.requests or state is None or not state.is_compacted:
            continue
        assert isinstance(state, ArkValeState)
        seen = state
        ids = e.kv.block_ids(rid)
        num_slots = e.kv.num_slots(req)
        for layer in range(2):
            for i, j in enumerate(state.resident[layer]):
                k, v = storage.read_block(layer, ids[i])
                assert torch.equal(k, truth_k[layer, j * BLOCK:(j + 1) * BLOCK]), (layer, i, j)
                assert torch.equal(v, truth_v[layer, j * BLOCK:(j + 1) * BLOCK]), (layer, i, j)
                assert state.pos[layer][:, i * BLOCK:(i + 1) * BLOCK].tolist() == [
                    list(range(j * BLOCK, (j + 1) * BLOCK))] * 2
            for j, (k, v) in state.host[layer].items():
                assert torch.equal(k, truth_k[layer, j * BLOCK:(j + 1) * BLOCK]), (layer, j)
                assert torch.equal(v, truth_v[layer, j * BLOCK:(j + 1) * BLOCK]), (layer, j)
            assert sorted(state.resident[layer] + list(state.host[layer])) == list(range(state.num_digested(layer)))
            tail_from = len(state.resident[layer]) * BLOCK
            positions = range(state.num_evicted + tail_from, state.num_evicted + num_slots)
            tail_k = storage.gather(layer, torch.tensor([ids]))[0][0, tail_from:num_slots]
            assert torch.equal(tail_k, truth_k[layer, list(positions)])
            assert state.pos[layer][0, tail_from:num_slots].tolist() == list(positions)
        num_checked += 1
        e.check_integrity()
    assert num_checked >= 150 and seen.num_compactions >= 10
    if policy != "arkvale":
        assert len(seen.recalls) >= 20


@pytest.mark.parametrize("fmt", ["native", "kivi2g8", "k=kivi4g8,v=int8"])
def test_arkvale_chooses_and_swaps_alike_with_the_cpu_and_the_torch_paths(loaded, monkeypatch, fmt):
    """The C++ pass (choice and trades in place: a quantized block's parts trade as bytes) and
    the torch path (``select_pages``' twin, ``KVStorage.swap_blocks``) give the same tokens and
    recalls, in the native format and quantized ones."""
    from kvserve.kv.budget import host_store, pages

    if pages.load_extension() is None:
        pytest.skip("the C++ page selection cannot be built here")
    runs = []
    for native in (True, False):
        if not native:      # the torch choice, and the swaps through KVStorage.swap_blocks
            monkeypatch.setattr(pages, "load_extension", lambda isa=None: None)
            monkeypatch.setattr(host_store, "load_extension", lambda isa=None: None)
        e = arkvale_engine(loaded, kv_format=fmt)
        rid = e.add_request(tokens(150), greedy(120, kv_budget=64, kv_policy="arkvale-m0"))
        out = e.step()
        state = e.kv.budgets.get(rid)
        assert isinstance(state, ArkValeState) and state.selector.is_native == native
        while e.has_unfinished:
            out = e.step()
        assert state._in_place is native        # the C++ pass traded the blocks in place, or not
        runs.append((out[0].token_ids, list(state.recalls)))
    assert runs[0] == runs[1] and len(runs[0][1]) > 0
