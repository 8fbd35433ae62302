"""ArkVale's page choice at a decode step: the C++ build and the torch twin decide alike, the
digest scores are ``block_scores``, and a swap must gain more than the margin."""

from __future__ import annotations

import pytest
import torch

from kvserve.extensions import supported_isas
from kvserve.kv.budget.arkvale import block_scores
from kvserve.kv.budget.pages import HOST, LOST, PAGES, RESIDENT, DigestBox, PageSelector, choose_swaps, load_extension

ISAS = supported_isas(PAGES)
needs_ext = pytest.mark.skipif(load_extension() is None, reason="the C++ page selection cannot be built here")


def digests(num_blocks: int, seed: int, kv_heads: int = 3, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(num_blocks, kv_heads, dim, generator=g), torch.randn(num_blocks, kv_heads, dim, generator=g)
    return torch.minimum(a, b), torch.maximum(a, b)


def marks(num_blocks: int, seed: int, num_resident: int, num_lost: int) -> torch.Tensor:
    order = torch.randperm(num_blocks - 2, generator=torch.Generator().manual_seed(seed)) + 1
    where = torch.full((num_blocks,), HOST, dtype=torch.uint8)
    where[[0, num_blocks - 1]] = RESIDENT
    where[order[:num_resident - 2]] = RESIDENT
    where[order[num_resident - 2:num_resident - 2 + num_lost]] = LOST
    return where


def stored_scores(box: DigestBox, q: torch.Tensor, weight: float) -> torch.Tensor:
    """The scores of the box as stored (float16 centres and half widths), in float64."""
    kv_heads, two_dim, _ = box.box.shape
    dim = two_dim // 2
    centre, half = box.box.double()[:, :dim], box.box.double()[:, dim:]          # [kv, dim, blocks]
    qg = q.double().view(kv_heads, -1, dim)
    s = (qg @ centre + weight * qg.abs() @ half).flatten(0, 1)                  # [heads, blocks]
    return (s - s.max(dim=1, keepdim=True).values).max(dim=0).values


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_the_digest_box_scores_blocks_as_block_scores(weight):
    """Exactly (to float32 order) the scores of the stored box, and within float16 rounding of
    ``block_scores`` over the float32 digests: each centre and half width moves by at most
    2^-11 of itself, so a head's score by 2^-11 sum |q| (|centre| + w half), a relative score by
    twice the largest of those."""
    dmin, dmax = digests(37, 3)
    q = torch.randn(9, 16, generator=torch.Generator().manual_seed(4))
    box = DigestBox(dmin, dmax)
    assert box.box.dtype == torch.float16
    assert torch.allclose(box.scores(q, weight).double(), stored_scores(box, q, weight), atol=1e-5)
    centre, half = ((dmax + dmin) / 2).abs(), (dmax - dmin) / 2                      # [blocks, kv, dim]
    qg = q.view(3, 3, 16).abs()
    per_head = 2.0 ** -11 * torch.einsum("kgd,bkd->bkg", qg, centre + weight * half)
    bound = 2 * per_head.max() + 1e-5
    assert (box.scores(q, weight) - block_scores(q, dmin, dmax, weight)).abs().max() <= bound
    grown = DigestBox.extend(DigestBox.extend(None, dmin[:20], dmax[:20]), dmin[20:], dmax[20:])
    assert grown.num_blocks == 37 and torch.equal(grown.box, box.box)


def test_a_box_grows_in_place_and_a_second_extension_of_the_same_box_copies():
    dmin, dmax = digests(41, 5)
    whole = DigestBox(dmin, dmax).box
    first = DigestBox.extend(None, dmin[:10], dmax[:10])
    a = DigestBox.extend(first, dmin[10:20], dmax[10:20])        # a new store, twice the size
    b = DigestBox.extend(a, dmin[20:25], dmax[20:25])            # in a's spare columns
    assert b.store is a.store and b.store.shape[2] == 40
    assert torch.equal(a.box, whole[:, :, :20]) and torch.equal(b.box, whole[:, :, :25])
    other = DigestBox.extend(a, dmax[30:35], dmax[30:35])        # a again: b owns those columns
    assert other.store is not a.store and torch.equal(b.box, whole[:, :, :25])
    assert torch.equal(other.box[:, :, :20], whole[:, :, :20]) and other.num_blocks == 25
    c = DigestBox.extend(b, dmin[25:40], dmax[25:40])            # fills the room
    assert c.store is b.store and torch.equal(c.box, whole[:, :, :40])
    d = DigestBox.extend(c, dmin[40:], dmax[40:])                # past it: copied
    assert d.store is not c.store and torch.equal(d.box, whole) and torch.equal(b.box, whole[:, :, :25])


@needs_ext
def test_the_cpu_choice_reads_a_box_with_spare_columns():
    dmin, dmax = digests(60, 6, dim=64)
    roomy = DigestBox.extend(DigestBox.extend(None, dmin[:30], dmax[:30]), dmin[30:], dmax[30:])
    tight = DigestBox(dmin, dmax)
    assert roomy.store.shape[2] > 60 and not roomy.box.is_contiguous()
    q = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    ext = load_extension()
    assert torch.equal(ext.digest_scores(roomy.store, 60, q, 0.5), ext.digest_scores(tight.store, 60, q, 0.5))
    where = marks(60, 6, 8, 3)
    assert torch.equal(ext.select_pages(roomy.store, 60, q, 0.5, where, 8, 0.0),
                       ext.select_pages(tight.store, 60, q, 0.5, where, 8, 0.0))


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0])
def test_the_cpu_scores_are_the_digest_box_scores(isa, weight):
    ext = load_extension(isa)
    for seed, num_blocks in enumerate([1, 2, 17, 480]):
        box = DigestBox(*digests(num_blocks, seed, dim=64))
        q = torch.randn(9, 64, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(ext.digest_scores(box.store, box.num_blocks, q, weight), box.scores(q, weight), atol=1e-4)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
def test_the_cpu_scores_hold_for_any_number_of_query_heads_per_kv_head(isa, group):
    """Any number of query heads per KV head, one to eight."""
    ext = load_extension(isa)
    for seed, num_blocks in enumerate([3, 16, 37]):
        box = DigestBox(*digests(num_blocks, seed, kv_heads=2, dim=32))
        q = torch.randn(2 * group, 32, generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(ext.digest_scores(box.store, num_blocks, q, 0.5), box.scores(q, 0.5), atol=1e-4)


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_the_cpu_choice_is_the_torch_twins(isa):
    ext = load_extension(isa)
    num_cases = num_swapping = 0
    for seed in range(40):
        num_blocks = 8 + seed * 7
        num_resident = 3 + seed % 5
        box = DigestBox(*digests(num_blocks, seed))
        q = torch.randn(9, 16, generator=torch.Generator().manual_seed(100 + seed))
        where = marks(num_blocks, seed, num_resident, num_lost=seed % 4)
        for margin in (0.0, 0.5, 2.0, 1e9):
            cpu = [tuple(p) for p in ext.select_pages(box.store, box.num_blocks, q, 0.5, where, num_resident, margin).tolist()]
            assert cpu == choose_swaps(box.scores(q, 0.5), where, num_resident, margin), (seed, margin)
            num_cases += 1
            num_swapping += bool(cpu)
    assert num_swapping >= num_cases // 3         # the cases do exercise swaps


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
def test_swap_pages_makes_the_swaps_select_pages_chooses_in_place(isa):
    """One decode step's pass: the pairs are the choice's (a host block with no pool row counts
    as lost, and is marked so); each incoming block's pool row and the device block of the
    outgoing one trade contents, and the row index, marks, resident list and positions follow."""
    from kvserve.kv.budget.host_store import HostBlockStore, StashKey

    ext = load_extension(isa)
    bs, num_blocks, resident = 2, 14, [0, 5, 7, 9, 13]
    table = [6, 2, 4, 1, 3, 0]                 # device block of each resident slot-block (and the tail's)
    num_done = 0
    for seed in range(6):
        box = DigestBox(*digests(num_blocks, seed, kv_heads=1, dim=4))
        q = torch.randn(2, 4, generator=torch.Generator().manual_seed(50 + seed))
        where = torch.full((num_blocks,), HOST, dtype=torch.uint8)
        where[resident] = RESIDENT
        store = HostBlockStore(1 << 20)
        for j in range(num_blocks):
            if where[j] == HOST and j != 3:   # block 3: evicted, never stashed here
                store.put(StashKey("a", 0, j), (torch.full((bs, 1, 4), 100.0 + j), torch.full((bs, 1, 4), -100.0 - j)))
        cache_k = torch.zeros(7, bs, 1, 4)
        for i, j in enumerate(resident):
            cache_k[table[i]] = float(j)
        cache_v = -cache_k
        pos = (torch.tensor(resident)[:, None] * bs + torch.arange(bs)).flatten()[None].repeat(2, 1)
        pos = torch.cat([pos, torch.full((2, 1), 99)], dim=1)
        lost = where.clone()
        lost[3] = LOST
        margin = 0.0 if seed % 2 == 0 else 1.0
        expected = choose_swaps(box.scores(q, 0.5), lost, len(resident), margin)
        places = list(resident)
        done = ext.swap_pages(box.store, num_blocks, q, 0.5, where, len(resident), margin,
                              store.rows_of("a", 0, num_blocks), store.pool, [cache_k], [cache_v], table, places, pos,
                              bs).tolist()
        assert [(j_in, j_out) for j_in, j_out, _ in done] == expected and where[3] == LOST
        store.swapped("a", 0, [(j_in, j_out) for j_in, j_out, _ in done])
        now = list(resident)
        for j_in, j_out, i in done:
            assert now[i] == j_out
            now[i] = j_in
            assert (cache_k[table[i]] == 100.0 + j_in).all() and (cache_v[table[i]] == -100.0 - j_in).all()
            assert (store.peek(StashKey("a", 0, j_out))[0] == j_out).all()
            assert (store.peek(StashKey("a", 0, j_out))[1] == -j_out).all()
            assert where[j_in] == RESIDENT and where[j_out] == HOST
        assert places == resident       # the caller's list is left to the caller
        want = (torch.tensor(now)[:, None] * bs + torch.arange(bs)).flatten()
        assert torch.equal(pos[:, :-1], want[None].repeat(2, 1)) and (pos[:, -1] == 99).all()
        store.check_integrity()
        num_done += len(done)
    assert num_done >= 3
    # a table naming a block past the pool for the last pair's slot: refused before any pair
    # is made (not after the first ones)
    for seed in range(20):
        box = DigestBox(*digests(num_blocks, seed, kv_heads=1, dim=4))
        q = torch.randn(2, 4, generator=torch.Generator().manual_seed(50 + seed))
        where = torch.full((num_blocks,), HOST, dtype=torch.uint8)
        where[resident] = RESIDENT
        expected = choose_swaps(box.scores(q, 0.5), where, len(resident), 0.0)
        if len(expected) >= 2:
            break
    assert len(expected) >= 2
    store = HostBlockStore(1 << 20)
    for j in range(num_blocks):
        if where[j] == HOST:
            store.put(StashKey("a", 0, j), (torch.full((bs, 1, 4), 100.0 + j), torch.full((bs, 1, 4), -100.0 - j)))
    rows = store.rows_of("a", 0, num_blocks)
    bad = list(table)
    bad[resident.index(expected[-1][1])] = 99
    stashed = rows[rows >= 0]                       # the pool's other rows are uninitialized memory
    before = (where.clone(), rows.clone(), cache_k.clone(), store.pool[stashed].clone(), pos.clone())
    with pytest.raises(RuntimeError, match="index out of range"):
        ext.swap_pages(box.store, num_blocks, q, 0.5, where, len(resident), 0.0, rows, store.pool, [cache_k],
                       [cache_v], bad, resident, pos, bs)
    after = (where, rows, cache_k, store.pool[stashed], pos)
    assert [torch.equal(a, b) for a, b in zip(before, after)] == [True] * 5
    with pytest.raises(RuntimeError, match="rows: contiguous int64"):
        ext.swap_pages(box.store, num_blocks, q, 0.5, where, len(resident), 0.0, torch.zeros(3, dtype=torch.long),
                       store.pool, [cache_k], [cache_v], table, resident, pos, bs)


def test_swaps_pair_the_best_host_block_with_the_worst_resident_one_while_they_gain_the_margin():
    # blocks 0 and 5 always stay (sinks, latest); 1, 2 resident; 3, 4 on the host
    score = torch.tensor([0.0, -3.0, -1.0, -0.5, -2.5, 0.0])
    where = torch.tensor([RESIDENT, RESIDENT, RESIDENT, HOST, HOST, RESIDENT], dtype=torch.uint8)
    assert choose_swaps(score, where, 4, 0.0) == [(3, 1)]            # top 4: 0, 5, 3, 2 -> 3 in, 1 out
    assert choose_swaps(score, where, 4, 2.49) == [(3, 1)]           # gains 2.5
    assert choose_swaps(score, where, 4, 2.5) == []                  # not more than the margin
    where[3] = LOST
    assert choose_swaps(score, where, 4, 0.0) == [(4, 1)]            # an evicted block never comes back
    assert choose_swaps(score, where, 4, 0.5) == []                  # -2.5 vs -3.0: gains 0.5 only


def test_the_selector_uses_torch_where_the_extension_is_off():
    box = DigestBox(*digests(30, 1))
    q = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    where = marks(30, 1, 6, 2)
    torch_only = PageSelector(torch.device("cpu"), use_extension=False)
    assert not torch_only.is_native
    assert torch_only.swaps(box, q, 0.5, where, 6, 0.0) == choose_swaps(box.scores(q, 0.5), where, 6, 0.0)
    assert torch.equal(torch_only.scores(box, q, 0.5), box.scores(q, 0.5))
