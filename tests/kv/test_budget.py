"""KV budget policies and states, without the engine: selection, merging, ArkVale recall."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny import TINY

from kvserve.kv.budget.arkvale import ArkValeState, block_scores
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import POLICIES, ArkVale, check_budget, get_policy, pyramid_budgets
from kvserve.kv.budget.state import BudgetState
from kvserve.kv.storage.paged import PagedKVCache

CPU = torch.device("cpu")


def test_registry_names_and_bad_names():
    assert list(POLICIES) == ["streaming", "h2o", "snapkv", "pyramid", "merge", "saliency", "saliency-blocks",
                             "arkvale", "arkvale-bound"]
    with pytest.raises(ValueError, match="unknown KV budget policy 'lru'; choose one of streaming, h2o"):
        get_policy("lru")
    with pytest.raises(ValueError, match="below the minimum of 32 tokens"):
        check_budget(31, get_policy("h2o"), 16)
    with pytest.raises(ValueError, match="multiple of the block size"):
        check_budget(40, get_policy("arkvale"), 16)
    check_budget(40, get_policy("h2o"), 16)
    assert get_policy("arkvale-w0.25") == ArkVale("arkvale-w0.25", is_paged=True, bound_weight=0.25)
    assert get_policy("arkvale-w1").bound_weight == get_policy("arkvale-bound").bound_weight == 1.0
    default = get_policy("arkvale")
    assert get_policy("arkvale-m0") == ArkVale("arkvale-m0", is_paged=True, recall_margin=0.0)
    assert get_policy("arkvale-m2.5-w1") == ArkVale("arkvale-m2.5-w1", is_paged=True, bound_weight=1.0,
                                                   recall_margin=2.5)
    assert get_policy("arkvale-w0").recall_margin == default.recall_margin
    for bad in ("arkvale-w", "arkvale-w1.5", "arkvale-w-0.1", "arkvale-wnan", "arkvale-wx", "arkvale-m-1",
                "arkvale-minf", "arkvale-mnan", "arkvale-w0-w1", "arkvale-x1", "arkvale-", "arkvale-w0.5m1"):
        with pytest.raises(ValueError, match="or arkvale-w<weight>-m<margin> .either part alone. with a weight "
                                             "from 0 to 1 and a margin >= 0"):
            get_policy(bad)


def test_pyramid_budgets_shrink_with_the_same_total():
    assert pyramid_budgets(64, 2) == [96, 32]
    b = pyramid_budgets(256, 30)
    assert sum(b) == 30 * 256 and b[0] == 384 and b[-1] == 128
    assert all(x >= y for x, y in itertools.pairwise(b))
    assert pyramid_budgets(100, 1) == [100]


def test_pyramid_budgets_in_whole_blocks_keep_the_total_rounded_down_to_a_block():
    b = pyramid_budgets(256, 30, 16)
    assert all(x % 16 == 0 for x in b) and sum(b) == 30 * 256
    assert b[0] == 384 and b[-1] == 128 and all(x >= y for x, y in itertools.pairwise(b))
    assert sum(pyramid_budgets(100, 30, 16)) == 3000 // 16 * 16
    assert pyramid_budgets(32, 30, 16)[-1] == 16        # the smallest budget: every layer keeps a block
    assert pyramid_budgets(64, 2, 16) == [96, 32] and pyramid_budgets(100, 1, 16) == [100]
    assert get_policy("pyramid").layer_budgets(200, 30, 16) == pyramid_budgets(200, 30, 16)
    assert get_policy("snapkv").layer_budgets(200, 30, 16) == [200] * 30


def test_streaming_keeps_sinks_and_recent_window():
    valid = torch.arange(10, 30)
    keep = get_policy("streaming").keep(valid, None, 8, 4, 2)
    assert keep.tolist() == [[10, 11, 12, 13, 26, 27, 28, 29]] * 2


def test_h2o_keeps_heavy_hitters_per_head_plus_the_window():
    valid = torch.arange(12)
    score = torch.zeros(2, 12)
    score[0, 2], score[0, 5] = 9, 8
    score[1, 0], score[1, 7] = 9, 8
    keep = get_policy("h2o").keep(valid, score, 6, 4, 2)
    assert keep.tolist() == [[2, 5, 8, 9, 10, 11], [0, 7, 8, 9, 10, 11]]


def test_snapkv_pools_scores_over_neighbours():
    valid = torch.arange(40)
    score = torch.zeros(1, 40)
    score[0, 10] = 5.0            # pooling (kernel 7) spreads it to slots 7 .. 13
    keep = get_policy("snapkv").keep(valid, score, 8, 2, 1)
    kept = keep[0].tolist()
    assert kept[-2:] == [38, 39] and set(kept[:6]) <= set(range(7, 14))


def _state(policy: str, budget: int = 8, block_size: int = 4, host_bytes: int = 1 << 30) -> BudgetState:
    p = get_policy(policy)
    if p.is_paged:
        return ArkValeState(p, budget, p.layer_budgets(budget, 2, block_size), 2, block_size, CPU, HostBlockStore(host_bytes), "r")
    return BudgetState(p, budget, p.layer_budgets(budget, 2, block_size), 2, block_size, CPU)


def test_merge_folds_evicted_entries_into_the_most_similar_kept_one():
    st = _state("merge", budget=2, block_size=2)
    st.prepare(0, 0, 3)
    # slot 0 scores high, slot 2 is the window; slot 1 (evicted) is most like slot 0
    k = torch.zeros(3, 2, 4)
    k[0, :, 0], k[1, :, 0], k[2, :, 1] = 1.0, 3.0, 1.0
    v = torch.arange(3, dtype=torch.float32)[:, None, None].expand(3, 2, 4).clone()
    for layer in range(2):
        st.add_scores(layer, torch.tensor([[5.0, 0.0, 1.0]] * 2))
    st.window = 1
    plan = st.plan([k, k], [v, v], 3)
    assert plan.pos[0].tolist() == [[0, 2], [0, 2]]
    assert plan.keys[0][0, 0].tolist() == [2.0, 0, 0, 0]          # mean of keys 1 and 3
    assert plan.values[0][:, 0, 0].tolist() == [0.5, 2.0]          # mean of values 0 and 1; 2 alone
    assert plan.weight[0].tolist() == [[2.0, 1.0], [2.0, 1.0]]
    assert plan.score[0].tolist() == [[5.0, 1.0], [5.0, 1.0]]


def test_probe_rows_are_chosen_by_position_however_the_prompt_is_chunked():
    st = _state("saliency", budget=64, block_size=16)       # window min(32, 64 // 2) = 32
    whole = st.probe_rows(0, 100, 100)
    assert whole == (15, 31, 47, 63, *range(68, 100))
    chunked = [40 + r for r in st.probe_rows(40, 30, 100)] + [70 + r for r in st.probe_rows(70, 30, 100)]
    assert tuple(r for r in whole if r >= 40) == tuple(chunked)
    assert st.probe_rows(100, 1, 101) == (0,)                # a decode query is always a probe


def test_saliency_normalizes_by_the_probes_that_saw_each_entry():
    st = _state("saliency", budget=2, block_size=2)
    st.prepare(0, 0, 4)
    st.record_probes(0, (1, 2, 3))      # probes at positions 1, 2, 3: positions 0-3 seen by 3, 3, 2, 1
    for layer in range(2):
        st.add_scores(layer, torch.tensor([[1.2, 0.9, 0.9, 0.3]] * 2))
    torch.testing.assert_close(st.saliency(0), torch.tensor([[0.4, 0.3, 0.45, 0.3]] * 2))
    torch.testing.assert_close(st.saliency(1, torch.tensor([3, 0])), torch.tensor([[0.3, 0.4]] * 2))


def test_saliency_blocks_keeps_the_sink_the_window_and_the_most_salient_blocks_whole():
    """Budget 8 of blocks of 2 (window min(32, 8 // 2) = 4: two blocks): 13 slots are six full
    blocks and an open one; kept: block 0, the window's blocks 4 and 5, and the most salient of
    blocks 1-3 by its best slot's saliency (summed over the two heads, averaged over the two
    layers), then the open block 6. Keeping them moves each slot's position, score and validity
    with its block."""
    st = _state("saliency-blocks", budget=8, block_size=2)
    st.prepare(0, 0, 13)
    st.record_probes(0, (12,))          # one probe, which saw every position
    scores = torch.zeros(2, 13)
    scores[:, 3], scores[:, 4], scores[:, 5] = 0.2, 0.5, 0.1      # block 1's best 0.2, block 2's 0.5
    st.add_scores(0, scores)
    st.add_scores(1, scores / 5)
    torch.testing.assert_close(st.block_saliency(6), torch.tensor([0.0, 0.24, 0.6, 0.0, 0.0, 0.0]))
    kept = st.choose_blocks(13)
    assert kept == [0, 2, 4, 5, 6]
    st.keep_blocks(kept, 13)
    assert st.pos[0][0, :9].tolist() == [0, 1, 4, 5, 8, 9, 10, 11, 12]
    assert st.valid[1][:10].tolist() == [True] * 9 + [False]
    torch.testing.assert_close(st.score[0][0, :4], torch.tensor([0.0, 0.0, 0.5, 0.1]))
    assert (st.num_recorded, st.num_evicted, st.block_holes) == (9, 4, ((4, 4), (4, 4)))
    assert _state("saliency-blocks", budget=4, block_size=2).window == 2


def test_saliency_keeps_the_highest_normalized_scores_pooled_over_neighbours():
    """Raw sums favour early entries (every later probe sees them); normalized, a later entry that
    took more of each probe's attention ranks above them. Scores are pooled as snapkv's (kernel 7)."""
    st = _state("saliency", budget=8, block_size=2)
    st.window = 1
    st.prepare(0, 0, 20)
    st.record_probes(0, tuple(range(1, 20)))          # position j seen by 20 - j probes (19 for j = 0)
    raw = torch.full((20,), 0.01)
    raw[0], raw[12] = 9.5, 6.0                        # normalized: 0.5 and 0.75
    for layer in range(2):
        st.add_scores(layer, raw.expand(2, 20))
    k = torch.randn(20, 2, 4)
    plan = st.plan([k, k], [k, k], 20)
    assert plan.pos[0].tolist() == [[9, 10, 11, 12, 13, 14, 15, 19]] * 2     # 12 and its pooled neighbours
    snap = get_policy("snapkv").keep(torch.arange(20), raw.expand(2, 20), 8, 1, 2)    # the raw sums
    assert snap[0].tolist()[:4] == [0, 1, 2, 3]


def test_block_scores_rank_by_the_digest_bound():
    dmin = torch.tensor([[[-1.0, 0.0]], [[0.0, 0.0]], [[2.0, -3.0]]])   # [3 blocks, 1 kv head, 2 dims]
    dmax = torch.tensor([[[1.0, 0.5]], [[0.1, 0.1]], [[2.0, 0.0]]])
    q = torch.tensor([[1.0, -1.0]])
    # bounds: block 0: 1 + 0 = 1; block 1: 0.1 + 0 = 0.1; block 2: 2 + 3 = 5
    assert block_scores(q, dmin, dmax).tolist() == pytest.approx([-4.0, -4.9, 0.0])
    # centres: block 0: 0 - 0.25 = -0.25; block 1: 0.05 - 0.05 = 0; block 2: 2 + 1.5 = 3.5
    assert block_scores(q, dmin, dmax, 0.0).tolist() == pytest.approx([-3.75, -3.5, 0.0])
    # half-widths weighted by |q|: 1.25, 0.1, 1.5; at weight 0.5: -0.25 + 0.625 = 0.375, 0.05, 4.25
    assert block_scores(q, dmin, dmax, 0.5).tolist() == pytest.approx([-3.875, -4.2, 0.0])


def test_arkvale_ranks_a_sharp_block_above_wide_ones_only_below_the_full_bound():
    """A block whose keys all lie near q's direction (narrow box) against blocks whose keys
    spread widely around zero: the bound prefers the wide ones though no key in them scores as
    high; the default weight ranks the sharp block first. One KV head, one query head."""
    q = torch.tensor([[1.0, 1.0]])
    sharp = torch.tensor([[2.0, 2.0], [2.2, 1.8]])                 # q.k = 4.0 for both keys
    wide = torch.tensor([[3.0, -3.0], [-3.0, 3.0]])                # q.k = 0 for both; box [-3, 3]^2
    keys = torch.stack([wide, sharp, wide])[:, :, None, :]          # [blocks, tokens, kv heads, dim]
    dmin, dmax = keys.amin(dim=1), keys.amax(dim=1)
    assert block_scores(q, dmin, dmax).tolist() == pytest.approx([0.0, -1.8, 0.0])      # bound 6 vs 4.2
    assert get_policy("arkvale").bound_weight == 0.5
    assert block_scores(q, dmin, dmax, 0.5).tolist() == pytest.approx([-1.1, 0.0, -1.1])  # 3 vs 4.1


def _arkvale_setup(host_bytes: int = 1 << 30):
    """6 full blocks of 4 tokens; block j's keys point along channel j (both layers);
    3 resident blocks (budget 12), of which block 0 (sinks) and the latest (5) always."""
    cache = PagedKVCache(TINY, num_blocks=16, block_size=4, dtype=torch.float32, device=CPU)
    table = [10, 11, 12, 13, 14, 15]
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        for j, block in enumerate(table):
            k = 0.01 * torch.rand(4, 2, 16, generator=g)
            k[:, :, j] += 5.0
            cache.key_caches[layer][block] = k
            cache.value_caches[layer][block] = float(j)
    st = _state("arkvale", budget=12, host_bytes=host_bytes)
    st.prepare(0, 0, 24)
    return cache, table, st


def _query(*channels: int) -> torch.Tensor:
    q = torch.zeros(4, 16)   # 4 query heads
    q[:, list(channels)] = 1.0
    return q


def _compact(cache, table, st):
    for layer in range(2):
        st.capture_query(layer, _query(4))
    keys = [cache.gather(layer, torch.tensor([table]))[0][0] for layer in range(2)]
    values = [cache.gather(layer, torch.tensor([table]))[1][0] for layer in range(2)]
    plan = st.plan(keys, values, 24)
    for layer in range(2):
        cache.write_slots(layer, plan.keys[layer], plan.values[layer], torch.arange(10 * 4, 13 * 4))
    st.apply(plan, 24)
    return plan


def test_arkvale_compaction_keeps_top_blocks_and_moves_the_rest_to_host():
    cache, table, st = _arkvale_setup()
    plan = _compact(cache, table, st)
    assert plan.num_slots == 12
    assert st.resident == [[0, 4, 5], [0, 4, 5]]
    assert [sorted(h) for h in st.host] == [[1, 2, 3], [1, 2, 3]]
    assert st.num_evicted == 12
    # 3 blocks x 2 layers x (K, V) x 4 tokens x 2 heads x 16 dims x 4 bytes
    assert st.host_nbytes == 3 * 2 * 2 * 4 * 2 * 16 * 4
    assert [cache.value_caches[0][b].unique().item() for b in (10, 11, 12)] == [0.0, 4.0, 5.0]


def test_arkvale_recalls_an_evicted_block_that_scores_high():
    cache, table, st = _arkvale_setup()
    original = cache.key_caches[0][11].clone()       # block 1's keys, layer 0
    _compact(cache, table, st)
    assert 1 in st.host[0]
    # the next query wants block 1: it comes back in place of block 4
    st.select(0, _query(1), cache, [10, 11, 12])
    assert st.recalls == [(0, 1)]
    assert st.resident[0] == [0, 1, 5] and st.resident[1] == [0, 4, 5]
    assert sorted(st.host[0]) == [2, 3, 4]
    assert torch.equal(cache.key_caches[0][11], original)
    assert [cache.value_caches[0][b].unique().item() for b in (10, 11, 12)] == [0.0, 1.0, 5.0]
    assert st.host[0][4][1].unique().tolist() == [4.0]
    # asked again, nothing moves
    st.select(0, _query(1), cache, [10, 11, 12])
    assert st.recalls == [(0, 1)]


def test_arkvale_cannot_recall_blocks_the_host_store_evicted():
    block_nbytes = 2 * 4 * 2 * 16 * 4                 # K and V of 4 tokens x 2 heads x 16 dims
    cache, table, st = _arkvale_setup(host_bytes=4 * block_nbytes)
    _compact(cache, table, st)
    # stashed layer 0's blocks 1, 2, 3, then layer 1's: the store keeps the newest four
    assert [sorted(h) for h in st.host] == [[3], [1, 2, 3]]
    assert st.host_store.num_evicted == 2 and st.host_nbytes == 4 * block_nbytes
    st.select(0, _query(3), cache, [10, 11, 12])      # a stashed block comes back
    assert st.recalls == [(0, 3)] and st.resident[0] == [0, 3, 5]
    assert [cache.value_caches[0][b].unique().item() for b in (10, 11, 12)] == [0.0, 3.0, 5.0]
    st.select(0, _query(1), cache, [10, 11, 12])      # an evicted one cannot: it ranks last
    assert 1 not in st.resident[0] and (0, 1) not in st.recalls
    st.host_store.check_integrity()
    st.release()
    assert st.host_store.num_blocks == 0 and st.host_nbytes == 0


def test_a_later_arkvale_compaction_moves_only_the_new_block_and_writes_rewritten_blocks_whole():
    """After the first compaction, a block filled during decode takes the slot of the lowest
    ranked resident block, which goes to the host; blocks that stay keep their slots, unless
    the KV manager replaces their table block by a fresh one (``rewritten``): those are written
    whole. The plan reads only the blocks it moves."""
    from kvserve.kv.budget.state import SlotReader

    cache, table, st = _arkvale_setup()
    _compact(cache, table, st)                                   # resident [0, 4, 5] in 10, 11, 12
    g = torch.Generator().manual_seed(1)
    for layer in range(2):                                       # block 6 (positions 24..27) in block 13
        k = 0.01 * torch.rand(4, 2, 16, generator=g)
        k[:, :, 6] += 5.0
        cache.key_caches[layer][13] = k
        cache.value_caches[layer][13] = 6.0
        st.capture_query(layer, _query(4))                      # block 4 high; 5 lowest; 0 and 6 on top
    st.prepare(12, 24, 4)
    reader = SlotReader(cache, [10, 11, 12, 13], 4, CPU)
    plan = st.plan_from(reader, 16, frozenset({0}))
    assert plan.num_slots == 12 and plan.slots == [[*range(8, 12), *range(4)]] * 2
    assert plan.resident == [[0, 4, 6], [0, 4, 6]]
    assert [s.indexes for s in plan.to_host] == [[5], [5]]
    assert plan.to_host[0].values is not None and plan.to_host[0].values.unique().tolist() == [5.0]
    new_table = [14, 11, 12]                                     # block 10 (slot block 0) replaced by 14
    for layer in range(2):
        slots = torch.tensor([new_table[s // 4] * 4 + s % 4 for s in plan.slots[layer]])
        cache.write_slots(layer, plan.keys[layer], plan.values[layer], slots)
    st.apply(plan, 28)
    assert [cache.value_caches[0][b].unique().item() for b in (14, 11, 12)] == [0.0, 4.0, 6.0]
    assert st.resident == [[0, 4, 6], [0, 4, 6]] and [sorted(h) for h in st.host] == [[1, 2, 3, 5]] * 2
    assert st.host[1][5][1].unique().tolist() == [5.0] and st.num_evicted == 16
    assert st.pos[0][0, :12].tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 24, 25, 26, 27]
    st.host_store.check_integrity()
