"""The C++ CPU backend against the float32 reference, in every KV format.

Tolerance: |out - ref| <= 2e-5 + 1e-5 |ref| elementwise. Both compute in float32 from the same
stored (decoded) keys and values; they differ only in rounding order: dot products of up to
128 terms summed in another association, the softmax in the log2 domain with a degree-7
polynomial exp2 (< 2 ulp), online rescaling and the split-K merge (a few roundings each),
and for ``+had`` the rotation applied to the query / output instead of every key / value.
Outputs are convex combinations of values of magnitude up to ~10, so these leave errors of
a few 1e-6 (the largest seen over this file's matrix is ~5e-6); a wrong row, block, scale or
mask moves outputs by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention.cases import Case, make_case, with_positions

from kvserve.attention import cpu
from kvserve.attention.cpu_extension import load_extension, supported_isas
from kvserve.kv.storage.layout import CodecKind, HalfLayout, HalfStore, PagedBatch

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the C++ CPU attention kernel cannot be built here")

ATOL, RTOL = 2e-5, 1e-5

# Every kind, group sizes below / at / above the vector width, the options alone and combined,
# K and V in different formats.
FORMATS = ["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int4g16", "int4g64", "int4g8", "kivi4", "kivi2",
           "int8+had", "kivi2+had", "int8+out4", "kivi2+out4", "int4+had+out4", "fp8+had+out2", "k=int8,v=int4",
           "k=kivi4+had,v=bf16"]

# One step of an engine: decodes and prefill chunks side by side, ragged. Decodes of 1 token,
# of an exact multiple of both block sizes and of an open block; a prefill chunk over cached
# context ending in an open block, one ending on a block boundary, a whole-prompt chunk.
LENS = [1, 64, 37, 129, 96, 37]
QUERIES = [1, 1, 1, 16, 9, 37]


def halves(spec: str) -> tuple[str, str | None]:
    if spec.startswith("k="):
        k, v = spec[2:].split(",v=")
        return k, v
    return spec, None


def check(case: Case, out: torch.Tensor | None = None) -> None:
    ref = case.reference()
    got = cpu.paged_attention(case.q, case.key, case.value, case.batch, case.scale, out=out)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("spec", FORMATS)
def test_decodes_and_prefill_chunks_match_reference(spec: str, group: int, head_dim: int, block_size: int) -> None:
    k, v = halves(spec)
    check(make_case(k, v, lens=LENS, num_queries=QUERIES, group=group, head_dim=head_dim, block_size=block_size,
                    seed=group + head_dim + block_size))


@pytest.mark.parametrize("group", [4, 5, 6, 7])
@pytest.mark.parametrize("spec", FORMATS)
def test_query_groups_of_the_models_users_run(spec: str, group: int) -> None:
    """Head dim 128 with 4-7 query heads per KV head (Llama's 4, Qwen2.5-1.5B's 6, 0.5B's 7):
    with AVX-512 decode tiles of 4, 5 and 6 rows read keys and values in place, 7 rows and the
    2-query chunks' 8-14 rows decode first and run as 6 + 1, 6 + 2, 6 + 4, 6 + 6 (+ 2) rows;
    contexts long enough to be split and prefetched far ahead."""
    k, v = halves(spec)
    check(make_case(k, v, lens=[1, 37, 700, 1100, 40], num_queries=[1, 1, 1, 1, 2], group=group, head_dim=128,
                    seed=group))


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "kivi2", "int4+had+out4"])
def test_long_contexts_split_over_the_cores(spec: str) -> None:
    """Thousands of tokens: the context is split (split-K) and the partials merged."""
    torch.manual_seed(0)
    case = make_case(spec, lens=[4100, 3000, 16, 1], num_queries=[1, 40, 1, 1], group=3, seed=7)
    check(case)
    single = make_case(spec, lens=[5000], num_queries=[1], num_kv_heads=3, group=3, seed=8)
    check(single)


def test_prefill_longer_than_a_tile() -> None:
    """A chunk of more query rows than one work item holds is cut into query tiles."""
    check(make_case("kivi2", lens=[300], num_queries=[300], group=3, seed=3))
    check(make_case("fp32", lens=[700, 50], num_queries=[200, 50], group=8, head_dim=128, block_size=32, seed=4))


# each sequence's queries at given positions: gaps, a run inside a block, one over a block's end
GAPPED_LENS, GAPPED = [40, 33, 7], [[3, 10, 11, 20, 31, 38, 39], [0, 15, 16, 17, 32], [6]]


@pytest.mark.parametrize("spec", ["fp32", "int8", "kivi2+out4", "kivi4+had"])
def test_queries_at_given_positions_match_the_reference(spec: str) -> None:
    """``PagedBatch.query_positions``: each query sees the keys up to its own position, through
    the unregistered and the registered entry points alike (a blend's rows, in the batch)."""
    k, v = halves(spec)
    case = with_positions(make_case(k, v, lens=GAPPED_LENS, num_queries=[7, 5, 1], group=3, seed=5), GAPPED)
    ref = case.reference()
    plain = make_case(k, v, lens=GAPPED_LENS, num_queries=[7, 5, 1], group=3, seed=5).reference()
    assert not torch.allclose(ref, plain)           # the positions matter
    check(case)
    ext = load_extension()
    halves_ = cpu.register_halves(ext, case.key, case.value, case.q.shape[-1])
    got = cpu.run_registered(ext, halves_, case.q.contiguous(), case.batch, case.scale)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("spec", ["fp32", "int8"])
def test_runs_of_queries_far_apart_get_the_bits_of_each_run_alone(spec: str) -> None:
    """Runs of queries more than kTileGap positions apart (a blend's rows: a few at each
    document's start and end; the kernel tiles them apart, so no row computes the keys between
    runs for nothing): each row's output is the reference's, and bit for bit what it gets when
    its run alone is the call (a row's arithmetic does not depend on the tile it shares). Formats
    without residual rows: a call ending inside a block would read that block's residual row."""
    from dataclasses import replace
    runs = [list(range(10)), list(range(100, 110)), list(range(300, 333)), list(range(550, 600))]
    positions = [p for run in runs for p in run]
    case = with_positions(make_case(spec, lens=[600], num_queries=[len(positions)], group=3, seed=6), [positions])
    check(case)
    ext = load_extension()
    got = cpu.run(ext, case.q, case.key, case.value, case.batch, case.scale)
    first = 0
    for run in runs:
        alone = replace(case.batch, context_lens=torch.tensor([run[-1] + 1], dtype=torch.int32),
                        query_starts=torch.tensor([0, len(run)], dtype=torch.int32), max_query_len=len(run),
                        max_context_len=run[-1] + 1, query_positions=torch.tensor(run, dtype=torch.int32))
        want = cpu.run(ext, case.q[first:first + len(run)], case.key, case.value, alone, case.scale)
        assert torch.equal(got[first:first + len(run)], want)
        first += len(run)


@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "kivi2+out4", "kivi4+had"])
def test_a_sliding_window_matches_the_reference(spec: str) -> None:
    """``PagedBatch.window``: each query sees its last ``window`` positions. Decodes past the
    window and within it, a prefill chunk whose first rows' windows start in other blocks than its
    last rows', a context long enough to split (windows that skip whole splits), and a window
    over queries at given positions; garbage stands in every block a window leaves."""
    from dataclasses import replace
    k, v = halves(spec)
    case = make_case(k, v, lens=[5, 70, 600, 1100, 45], num_queries=[1, 1, 1, 37, 45], group=3, seed=9)
    for window in (1, 7, 16, 33, 300):
        windowed = replace(case, batch=replace(case.batch, window=window))
        assert not torch.allclose(windowed.reference(), case.reference())    # the window matters
        check(windowed)
    gapped = with_positions(make_case(k, v, lens=GAPPED_LENS, num_queries=[7, 5, 1], group=3, seed=5), GAPPED)
    check(replace(gapped, batch=replace(gapped.batch, window=9)))


def test_bad_query_positions_raise() -> None:
    case = make_case("fp32", lens=[40], num_queries=[3], seed=1)
    for positions, match in (([[3, 10, 38]], "last query must sit at its last context position"),
                             ([[10, 3, 39]], "query positions must ascend"),
                             ([[-1, 3, 39]], "query positions must ascend")):
        with pytest.raises(ValueError, match=match):
            check(with_positions(case, positions))


def test_residual_and_plain_halves_in_one_call() -> None:
    case = make_case("kivi2", lens=LENS, num_queries=QUERIES, group=3)
    assert case.key.residual is not None and case.value.residual is None
    assert (case.batch.open_rows >= 0).any()
    check(case)


def test_open_rows_of_full_last_blocks_are_ignored() -> None:
    case = make_case("kivi4", lens=[32, 64, 20], num_queries=[1, 3, 1], group=3)
    assert case.batch.open_rows.tolist() == [-1, -1, 2]
    ref = case.reference()
    b = case.batch
    # name a residual row (holding other numbers) for the sequences whose last block is full
    batch = PagedBatch(b.block_tables, b.context_lens, b.query_starts, torch.tensor([0, 1, 2], dtype=torch.int32),
                       b.block_size, b.max_query_len, b.max_context_len)
    torch.testing.assert_close(cpu.paged_attention(case.q, case.key, case.value, batch, case.scale), ref,
                               atol=ATOL, rtol=RTOL)


def poisoned(case: Case) -> Case:
    """The case with NaN (float parts) and random bytes (integer parts) wherever a kernel must
    not read: blocks no table names, token rows past each sequence's length, the encoded
    parts of blocks that live in residual rows, residual rows no sequence uses."""
    b = case.batch
    bs = b.block_size
    lens, opens = b.context_lens.tolist(), b.open_rows.tolist()
    g = torch.Generator().manual_seed(1)

    def poison(store: HalfStore) -> HalfStore:
        parts = {n: t.clone() for n, t in store.parts.items()}
        num_blocks = next(iter(parts.values())).shape[0]
        used = torch.zeros(num_blocks, bs, dtype=torch.bool)          # token rows read from the parts
        whole = torch.zeros(num_blocks, dtype=torch.bool)             # blocks whose per-block parts are read
        for s, length in enumerate(lens):
            ids = b.block_tables[s, :-(-length // bs)].tolist()
            for i, block in enumerate(ids):
                n = min(bs, length - i * bs)
                if n < bs and store.residual is not None and opens[s] >= 0:
                    continue                                          # read from the residual row
                used[block, :n] = True
                whole[block] = True
        for name, t in parts.items():
            per_token = name in ("data", "codes", "outlier_values") or (
                name in ("scale", "zero") and store.layout.kind != CodecKind.ASYM_CHANNEL)
            mask = ~used if per_token else ~whole
            mask = mask.view(*mask.shape, *([1] * (t.dim() - mask.dim())))
            if t.is_floating_point():
                t.masked_fill_(mask.expand_as(t), math.nan)
            else:
                junk = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8).view(t.dtype)
                t.copy_(torch.where(mask.expand_as(t), junk, t))
        residual = None
        if store.residual is not None:
            residual = torch.full_like(store.residual, math.nan)
            for s, length in enumerate(lens):
                if opens[s] >= 0 and length % bs:
                    residual[opens[s], :length % bs] = store.residual[opens[s], :length % bs]
        return HalfStore(store.layout, parts, residual)

    return Case(case.q, case.key_codec, poison(case.key), case.value_codec, poison(case.value), case.batch,
                case.scale)


@pytest.mark.parametrize("spec", ["fp32", "bf16", "fp8", "int8", "int4g16", "kivi2", "kivi4+out2", "int8+had+out2"])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_garbage_is_never_read(spec: str, group: int) -> None:
    case = make_case(spec, lens=[1, 17, 32, 45, 300], num_queries=[1, 1, 5, 45, 1], group=group)
    ref = case.reference()
    bad = poisoned(case)
    assert any(t.isnan().any() for t in bad.key.parts.values() if t.is_floating_point())
    got = cpu.paged_attention(case.q, bad.key, bad.value, case.batch, case.scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_query_dtype_and_out(dtype: torch.dtype) -> None:
    """Compute is float32 whatever q's dtype; the result comes back in q's dtype (into out)."""
    case = make_case("int8", lens=[40, 7], num_queries=[1, 7], group=3)
    q = case.q.to(dtype)
    out = torch.full_like(q, math.nan)
    got = cpu.paged_attention(q, case.key, case.value, case.batch, case.scale, out=out)
    assert got is out and got.dtype == dtype
    rounded = Case(q.float(), case.key_codec, case.key, case.value_codec, case.value, case.batch, case.scale)
    tol = 1e-2 if dtype != torch.float32 else ATOL   # the output's own rounding to 16 bits
    torch.testing.assert_close(got.float(), rounded.reference().to(dtype).float(), atol=tol, rtol=tol)


def test_sequences_without_queries_are_skipped() -> None:
    case = make_case("kivi2", lens=[30, 50, 9], num_queries=[2, 0, 1], group=3)
    check(case)


@pytest.mark.parametrize("isa", [i for i in ("avx2", "scalar") if i in supported_isas()[1:]])
@pytest.mark.parametrize("spec", ["fp32", "bf16", "fp8", "int8", "int4g16", "int4g8", "kivi2", "kivi4+had+out2"])
def test_narrower_builds_match_the_reference(isa: str, spec: str) -> None:
    """The AVX2 and scalar builds (compiled on first use, then cached) where this CPU runs them."""
    ext = load_extension(isa)
    assert ext is not None and ext.isa == isa
    for group, head_dim in ((1, 64), (3, 64), (8, 128)):
        case = make_case(spec, lens=LENS + [1000], num_queries=QUERIES + [1], group=group, head_dim=head_dim)
        got = cpu.run(ext, case.q, case.key, case.value, case.batch, case.scale)
        torch.testing.assert_close(got, case.reference(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("head_dim", [24, 40])
@pytest.mark.parametrize("spec", ["kivi2g8", "int2g8"])
def test_2_bit_rows_whose_width_is_not_a_multiple_of_16(spec: str, head_dim: int) -> None:
    """Where vectors are 8 channels wide, the kernel reads two vectors' 2-bit codes from one
    32-bit word; a row's last 8 channels after the last whole word are read from their own 2
    bytes (not past the row). Every build this CPU runs."""
    for isa in supported_isas():
        ext = load_extension(isa)
        assert ext is not None
        case = make_case(spec, lens=LENS, num_queries=QUERIES, group=3, head_dim=head_dim, seed=head_dim)
        got = cpu.run(ext, case.q, case.key, case.value, case.batch, case.scale)
        torch.testing.assert_close(got, case.reference(), atol=ATOL, rtol=RTOL)


# ---- layouts and inputs the kernel must refuse ----

def small_case() -> Case:
    return make_case("kivi2", lens=[20, 32], num_queries=[1, 2], group=3)


def replace_layout(store: HalfStore, **changes: object) -> HalfStore:
    fields = {f: getattr(store.layout, f) for f in ("kind", "plain_dtype", "bits", "group_size", "hadamard",
                                                     "num_outliers")}
    fields.update(changes)
    return HalfStore(HalfLayout(**fields), store.parts, store.residual)  # type: ignore[arg-type]


def run_small(case: Case, **kw: object) -> torch.Tensor:
    args = {"q": case.q, "key": case.key, "value": case.value, "batch": case.batch, "scale": case.scale}
    args.update(kw)
    return cpu.paged_attention(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("half, change, match", [
    ("value", {"bits": 3}, "2 or 4 bits"),
    ("value", {"bits": 4}, "codes must have shape"),
    ("value", {"group_size": 5}, "does not divide"),
    ("key", {"num_outliers": 2}, "parts"),
    ("value", {"kind": CodecKind.INT8}, "parts"),
    ("key", {"kind": CodecKind.PLAIN, "plain_dtype": torch.int8}, "parts|plain storage"),
])
def test_bad_layouts_raise(half: str, change: dict[str, object], match: str) -> None:
    case = small_case()
    with pytest.raises(ValueError, match=match):
        run_small(case, **{half: replace_layout(getattr(case, half), **change)})


def test_bad_inputs_raise() -> None:
    case = small_case()
    b = case.batch

    def batch(**kw: object) -> PagedBatch:
        fields = {f: getattr(b, f) for f in ("block_tables", "context_lens", "query_starts", "open_rows",
                                             "block_size", "max_query_len", "max_context_len")}
        fields.update(kw)
        return PagedBatch(**fields)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="q must be"):
        run_small(case, q=case.q[0])
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        run_small(case, q=case.q[:, :5].contiguous())
    with pytest.raises(ValueError, match="outside the cache"):
        run_small(case, batch=batch(block_tables=b.block_tables + 1000))
    with pytest.raises(ValueError, match="queries but only"):
        run_small(case, batch=batch(context_lens=torch.tensor([20, 1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="within q's rows"):
        run_small(case, batch=batch(query_starts=torch.tensor([0, 1, 40], dtype=torch.int32)))
    with pytest.raises(ValueError, match="residual row"):
        run_small(case, batch=batch(open_rows=torch.tensor([-1, -1], dtype=torch.int32)))
    with pytest.raises(ValueError, match="block_tables must be int32"):
        run_small(case, batch=batch(block_tables=b.block_tables.long()))
    with pytest.raises(ValueError, match="contiguous"):
        codes = case.key.parts["codes"]
        strided = torch.empty(codes.shape[0], codes.shape[1], codes.shape[2], 2 * codes.shape[3],
                              dtype=codes.dtype)[..., ::2]
        strided.copy_(codes)
        run_small(case, key=HalfStore(case.key.layout, {**case.key.parts, "codes": strided}, case.key.residual))
    with pytest.raises(ValueError, match="Hadamard|power-of-two"):
        odd = make_case("int8", lens=[5], num_queries=[1], head_dim=48)
        run_small(odd, key=replace_layout(odd.key, hadamard=True))


def test_without_a_compiler_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog) -> None:
    """One log line and None (the engine then uses the torch backend), never an exception."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING"):
        assert load_extension.__wrapped__("scalar") is None
    assert len(caplog.records) == 1 and "no C++ compiler" in caplog.records[0].getMessage()
