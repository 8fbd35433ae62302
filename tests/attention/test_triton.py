"""The Triton backend against the float32 reference, in every KV format.

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter: the
module is imported with TRITON_INTERPRET=1 (restored afterwards, so no other test module
sees it), and shapes stay at a few hundred keys (the interpreter runs each program's ops
through numpy, one program at a time). On a CUDA machine the same tests run the compiled
kernels on the GPU.

Tolerances. float32 q: the kernel and the reference compute the same float32 values in a
different order (tiled online softmax, tl.dot, split merges; for ``+had`` a dot with the
+-1 matrix where the codec runs the FWHT): observed errors stay below 5e-6 on outputs of
size ~1, so 2e-5 absolute + 2e-5 relative catches any real mistake (a misread channel,
scale or token moves outputs by 1e-2 and more). float16 / bfloat16 q: the kernel rounds
q, K, V and the probabilities to q's dtype for the products (as the torch path's decode to
the compute dtype + SDPA does) and the output to q's dtype, while the reference computes in
float32 from the same q: a few roundings of 2^-11 (fp16) / 2^-8 (bf16) relative.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from attention.cases import Case, make_case

from kvserve.kv.storage.layout import CodecKind, HalfStore, PagedBatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _load_kernels() -> ModuleType:
    """kvserve.attention.triton_kernels, its kernels decorated for the interpreter when there
    is no GPU. Triton decorates its own library functions when it is first imported, so the
    variable must be set before then too."""
    if DEVICE == "cuda":
        pytest.importorskip("triton")
        return importlib.import_module("kvserve.attention.triton_kernels")
    if "triton" in sys.modules and "kvserve.attention.triton_kernels" not in sys.modules:
        # another test module may have imported triton under the interpreter already (fine)
        standard = sys.modules.get("triton.language.standard")
        if standard is None or type(standard.cdiv).__name__ != "InterpretedFunction":
            raise RuntimeError("triton was imported before this module could set TRITON_INTERPRET=1")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        importlib.import_module("triton.experimental.gluon")   # imported lazily at the first launch
        module = importlib.import_module("kvserve.attention.triton_kernels")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    if not module.is_interpreted():
        raise RuntimeError("kvserve.attention.triton_kernels was imported before TRITON_INTERPRET=1 was set")
    return module


tk = _load_kernels()


def _openblas_threads() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    """(set, get) of the thread count of the OpenBLAS numpy loaded, if it is OpenBLAS."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            setter, getter = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
            if hasattr(lib, setter) and hasattr(lib, getter):
                return getattr(lib, setter), getattr(lib, getter)
    return None


@pytest.fixture(scope="module", autouse=True)
def single_threaded_cpu() -> Iterator[None]:
    """The interpreter runs numpy ops of a few KB, one after another: waking thread pools for
    them on 2 busy cores costs more than the work (OpenBLAS: ~15 ms a tl.dot instead of
    0.03 ms; torch's OpenMP threads spin between the small ops of make_case and the
    reference). One thread each for this module; restored after it."""
    if DEVICE != "cpu":
        yield
        return
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    blas = _openblas_threads() if os.path.exists("/proc/self/maps") else None
    blas_threads = blas[1]() if blas else 0
    if blas:
        blas[0](1)
    yield
    torch.set_num_threads(torch_threads)
    if blas:
        blas[0](blas_threads)


def run(case: Case, **kwargs) -> torch.Tensor:
    return tk.paged_attention(case.q, case.key, case.value, case.batch, case.scale, **kwargs)


def check(case: Case, out: torch.Tensor | None = None, reference: torch.Tensor | None = None) -> None:
    out = run(case) if out is None else out
    ref = case.reference() if reference is None else reference
    tol = TOL[case.q.dtype]
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def forced_splits(case: Case, block_n: int = 16) -> tk.LaunchConfig:
    """A config cutting every sequence into splits of one tile unit (many merges)."""
    cfg = tk.launch_config(case.q, case.batch, case.key.parts[next(iter(case.key.parts))].shape[2])
    unit = math.lcm(block_n, case.batch.block_size)
    return replace(cfg, block_n=block_n, tokens_per_split=unit, num_splits=-(-case.batch.max_context_len // unit))


# Every kind, the options on both halves and per half, residual rows on one half or both:
# fp32/fp16/bf16 plain, fp8, int8, int4g32, kivi4 (K 4-bit per channel + residual rows,
# V int4g32), kivi2 (K 2-bit per channel, V int2g32), +had (folded into q / the output),
# +had+out4 (rotated tiles, outliers on both halves), +out4 on KIVI (residual rows on both
# halves), K and V of different kinds.
FORMATS = [("fp32", None), ("fp16", None), ("bf16", None), ("fp8", None), ("int8", None), ("int4", None),
           ("kivi4", None), ("kivi2", None), ("int8+had", None), ("fp8+had+out4", None), ("kivi2+out4", None),
           ("kivi4+had", "int4g16+had"), ("int8", "kivi2")]


def matrix_case(fmt: tuple[str, str | None], mode: str, group: int, head_dim: int, block_size: int,
                dtype: torch.dtype = torch.float32, heads: int = 1) -> Case:
    """Ragged sequences: 1 token; exact block multiples; an open last block. Decode: one
    query each. Prefill: a 1-token prompt, 16 queries ending at a block boundary, and a
    9-query chunk that ends in the open block, over cached context. One KV head (the
    interpreter's time grows with the programs; other tests use several)."""
    b = block_size
    lens = [1, 2 * b, 3 * b + 5]
    queries = [1, 1, 1] if mode == "decode" else [1, 16, 9]
    return make_case(fmt[0], fmt[1], lens=lens, num_queries=queries, num_kv_heads=heads, group=group,
                     head_dim=head_dim, block_size=b, dtype=dtype, device=DEVICE, seed=group + head_dim + b)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0] if f[1] is None else f"k={f[0]},v={f[1]}")
def test_every_format_against_the_reference(fmt: tuple[str, str | None], mode: str, group: int, head_dim: int,
                                            block_size: int) -> None:
    check(matrix_case(fmt, mode, group, head_dim, block_size))


# the options on every quantized kind, and group sizes: one shape each
OPTION_FORMATS = [f"{kind}{option}" for kind in ("fp8", "int8", "int4g16", "int2", "kivi4", "kivi2")
                  for option in ("+had", "+out2", "+had+out4")] + ["int4g64", "int2g8", "kivi2g64", "int4g128"]


@pytest.mark.parametrize("fmt", OPTION_FORMATS)
def test_options_and_group_sizes_on_every_quantized_kind(fmt: str) -> None:
    case = make_case(fmt, lens=[5, 32, 45], num_queries=[1, 1, 12], num_kv_heads=2, group=2, head_dim=128,
                     block_size=16, device=DEVICE, seed=7)
    check(case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("fmt", [("native", None), ("int8", None), ("kivi2", None), ("fp8+had+out4", None),
                                 ("kivi4+had", "int4+had")], ids=str)
def test_half_precision_queries(fmt: tuple[str, str | None], mode: str, dtype: torch.dtype) -> None:
    """The compute dtypes of a GPU: products in q's dtype, float32 accumulation."""
    check(matrix_case(fmt, mode, group=3, head_dim=128, block_size=16, dtype=dtype, heads=2))


@pytest.mark.parametrize("fmt", [("fp32", None), ("int4", None), ("kivi2", None), ("fp8+had+out4", "int8+had")],
                         ids=str)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_split_contexts_merge_exactly(fmt: tuple[str, str | None], mode: str) -> None:
    """Flash-decoding: every sequence cut into splits of 16 or 32 keys (the open block in the
    last one, prefill queries masked out of whole splits), merged by each tile's last split
    program, twice through one scratch (its tickets back at zero after each call), and by the
    second kernel: the same bits (the same sums in the same order)."""
    launcher = tk.Launcher()
    scratch = launcher.scratch
    for block_size in (16, 32):
        case = matrix_case(fmt, mode, group=3, head_dim=64, block_size=block_size)
        cfg = forced_splits(case)
        assert cfg.num_splits >= 3 and cfg.merge_in_kernel
        fused = run(case, config=cfg, launcher=launcher)
        scratch.check_integrity()
        check(case, fused)
        assert torch.equal(run(case, config=cfg, launcher=launcher), fused)
        scratch.check_integrity()
        assert torch.equal(run(case, config=replace(cfg, merge_in_kernel=False)), fused)


def test_a_steps_plan_is_made_once_for_all_its_layers() -> None:
    """The launcher checks and cuts a batch once: the same batch object (every layer of a step)
    gets the same plan back; another batch (the next step, a sliding window's) its own, the
    latest KEPT_PLANS kept; another config its own; a bad batch is refused as before."""
    case = make_case("int8", lens=[40, 300], num_queries=[1, 1], num_kv_heads=2, group=2, device=DEVICE, seed=1)
    launcher = tk.Launcher()
    plan = launcher.plan(case.q, case.batch, 2)
    assert launcher.plan(case.q, case.batch, 2) is plan
    window = replace(case.batch, window=64)
    assert launcher.plan(case.q, window, 2) is not plan and launcher.plan(case.q, case.batch, 2) is plan
    forced = forced_splits(case)
    split = launcher.plan(case.q, case.batch, 2, forced)
    assert split is not plan and split.partials is not None and split.tickets is not None
    assert split.tickets.numel() == 2 * 1 * 2      # sequences x query tiles x KV heads
    for _ in range(tk.Launcher.KEPT_PLANS):
        launcher.plan(case.q, replace(case.batch), 2)
    assert launcher.plan(case.q, case.batch, 2) is not plan
    check(case, run(case, launcher=launcher))
    check(case, run(case, config=forced, launcher=launcher))
    bad = replace(case.batch, context_lens=case.batch.context_lens.long())
    with pytest.raises(ValueError, match="context_lens"):
        launcher.plan(case.q, bad, 2)


def test_split_scratch_is_reused_and_grown() -> None:
    """Partials are views of one buffer per device, grown only when a call needs more; tickets
    come zeroed and are kept, a larger request keeping the count."""
    scratch = tk.SplitScratch()
    acc, m, s = scratch.partials(3, 10, 64, torch.device("cpu"))
    assert acc.shape == (3, 10, 64) and m.shape == s.shape == (3, 10)
    assert acc.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
    again = scratch.partials(2, 10, 64, torch.device("cpu"))[0]
    assert again.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr()
    assert scratch.partials(4, 10, 64, torch.device("cpu"))[0].untyped_storage().data_ptr() != acc.untyped_storage().data_ptr()
    tickets = scratch.tickets(5, torch.device("cpu"))
    assert tickets.tolist() == [0] * 5 and tickets.dtype == torch.int32
    tickets[1] = 1
    with pytest.raises(AssertionError, match="1 split tickets"):
        scratch.check_integrity()
    tickets[1] = 0
    assert scratch.tickets(12, torch.device("cpu")).shape == (12,)
    scratch.check_integrity()


@pytest.mark.parametrize("fmt,block_size", [("fp32", 16), ("kivi2", 16), ("int4+had+out4", 256)])
def test_several_thousand_tokens(fmt: str, block_size: int) -> None:
    """A 4,000-token decode and an 8-query chunk at the end of 3,000 cached tokens (8 query
    heads on one KV head), in one call; in one split and in 8 splits of 512 keys merged.
    Tiles of 256 keys (16 blocks of 16) or 128 keys (half a block of 256): the interpreter's
    time is per tile, not per key."""
    lens = [4000, 3003] if block_size == 16 else [4001, 3000]
    case = make_case(fmt, lens=lens, num_queries=[1, 8], num_kv_heads=1, group=8, head_dim=64,
                     block_size=block_size, device=DEVICE, seed=3)
    ref = case.reference()
    cfg = replace(tk.launch_config(case.q, case.batch, 1), block_n=256 if block_size == 16 else 128, tokens_per_split=4096,
                  num_splits=1)
    check(case, run(case, config=cfg), reference=ref)
    check(case, run(case, config=replace(cfg, tokens_per_split=512, num_splits=8)), reference=ref)


def test_odd_head_dim_and_block_size() -> None:
    """head_dim 96 (padded to 128, gathered codes) and a 24-token block (tiles straddle blocks)."""
    for fmt in ("fp16", "kivi2+out2"):
        case = make_case(fmt, lens=[24, 50, 7], num_queries=[1, 20, 7], num_kv_heads=2, group=3, head_dim=96,
                         block_size=24, device=DEVICE, seed=5)
        check(case)


@pytest.mark.parametrize("fmt", ["int8+had", "kivi2+out4"])
def test_group_of_32_and_head_dim_256(fmt: str) -> None:
    """Rows past 16 (a 32-head group: 32 rows a query) and the widest head (32-key tiles). On a
    GPU, float32 queries with ``+had`` at head_dim 256 are refused: the 256 x 256 float32
    Hadamard matrix the kernel folds into q and the output alone is 256 KB of shared memory
    (an H100 or H200 has 227 KB); in bfloat16 it runs."""
    for group, head_dim in ((32, 64), (4, 256)):
        case = make_case(fmt, lens=[1, 40, 77], num_queries=[1, 3, 12], num_kv_heads=1, group=group,
                         head_dim=head_dim, block_size=16, device=DEVICE, seed=group)
        if DEVICE == "cuda" and head_dim == 256 and fmt == "int8+had":
            with pytest.raises(ValueError, match="does not fit this device's shared memory"):
                run(case)
            case = make_case(fmt, lens=[1, 40, 77], num_queries=[1, 3, 12], num_kv_heads=1, group=group,
                             head_dim=head_dim, block_size=16, dtype=torch.bfloat16, device=DEVICE, seed=group)
        check(case)


class SharedMemoryOf:
    """``attend`` as a device with ``limit`` bytes of shared memory would run it: a launch
    whose tile and stages need more raises Triton's OutOfResources (the interpreter has no
    such limit; on an H200, fp32 queries with ``+had+out4`` at head_dim 128 needed 256 KB)."""

    def __init__(self, kernel: object, limit: int) -> None:
        self.kernel, self.limit, self.launches = kernel, limit, []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            need = 2048 * int(kwargs["BLOCK_N"]) * int(kwargs["num_stages"])   # a stand-in for the tiles' bytes
            self.launches.append((kwargs["BLOCK_N"], kwargs["num_stages"]))
            if need > self.limit:
                raise tk.triton_jit.OutOfResources(need, self.limit, "shared memory")
            self.kernel[grid](*args, **kwargs)
        return launch

    def install(self, monkeypatch: pytest.MonkeyPatch) -> SharedMemoryOf:
        interpreted = tk.is_interpreted()        # (read from the kernel's type, which this hides)
        monkeypatch.setattr(tk, "is_interpreted", lambda: interpreted)
        monkeypatch.setattr(tk, "_FITTED", {})
        monkeypatch.setattr(tk.triton_jit, "attend", self)
        return self


def test_a_launch_too_big_for_shared_memory_takes_one_stage_then_smaller_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    case = matrix_case(("kivi2+out4", None), "prefill", group=3, head_dim=64, block_size=16)
    cfg = tk.launch_config(case.q, case.batch, 1)
    assert (cfg.block_n, cfg.num_stages) == (64, 2)
    assert [(c.block_n, c.num_stages) for c in tk.smaller_configs(cfg)] == [(64, 1), (32, 1), (16, 1)]
    fake = SharedMemoryOf(tk.triton_jit.attend, limit=2048 * 32).install(monkeypatch)
    check(case)
    assert fake.launches == [(64, 2), (64, 1), (32, 1)]
    check(case)                                          # remembered: straight to the config that fits
    assert fake.launches[3:] == [(32, 1)]
    case = matrix_case(("kivi2+out4", None), "prefill", group=3, head_dim=64, block_size=32)
    split = forced_splits(case, block_n=64)              # splits of 64 keys, run in tiles of 32
    assert split.num_splits == 2
    check(case, run(case, config=split))
    assert fake.launches[4:] == [(64, 2), (64, 1), (32, 1)]


def test_a_launch_that_never_fits_is_refused_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    case = matrix_case(("int8+had", None), "decode", group=3, head_dim=64, block_size=16)
    SharedMemoryOf(tk.triton_jit.attend, limit=0).install(monkeypatch)
    with pytest.raises(ValueError, match=r"does not fit this device's shared memory for int8\+had keys and int8\+had "
                                         r"values at head_dim 64 in torch.float32, even in 16-key tiles .*use a 16-bit"):
        run(case)


def test_residual_on_one_half_only() -> None:
    """kivi2: keys keep a residual row for the open block, values do not, in the same call."""
    case = matrix_case(("kivi2", None), "prefill", group=3, head_dim=64, block_size=16)
    assert case.key.residual is not None and case.value.residual is None
    assert case.batch.open_rows.tolist() == [0, -1, 2]
    check(case)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "kivi2+out4"])
def test_queries_at_given_positions(fmt: str) -> None:
    """``PagedBatch.query_positions`` (a prefill with gaps): each query over the keys up to its
    own position, one tile and several, with splits."""
    from attention.cases import with_positions

    case = with_positions(make_case(fmt, lens=[40, 33, 7], num_queries=[7, 5, 1], num_kv_heads=2, group=3,
                                    block_size=16, device=DEVICE, seed=5),
                          [[3, 10, 11, 20, 31, 38, 39], [0, 15, 16, 17, 32], [6]])
    check(case)
    check(case, run(case, config=forced_splits(case)))


@pytest.mark.parametrize("fmt", ["fp32", "int8", "kivi2+out4"])
def test_a_sliding_window(fmt: str) -> None:
    """``PagedBatch.window``: each query sees its last ``window`` positions (decodes past it and
    within it, a chunk whose rows' windows start in different blocks, queries at given
    positions), in one split and in splits a window skips."""
    from attention.cases import with_positions

    case = make_case(fmt, lens=[5, 70, 200, 45], num_queries=[1, 1, 19, 45], num_kv_heads=2, group=3,
                     block_size=16, device=DEVICE, seed=9)
    for window in (1, 7, 33):
        windowed = replace(case, batch=replace(case.batch, window=window))
        check(windowed)
        check(windowed, run(windowed, config=forced_splits(windowed)))
    gapped = with_positions(make_case(fmt, lens=[40, 33, 7], num_queries=[7, 5, 1], num_kv_heads=2, group=3,
                                      block_size=16, device=DEVICE, seed=5),
                            [[3, 10, 11, 20, 31, 38, 39], [0, 15, 16, 17, 32], [6]])
    check(replace(gapped, batch=replace(gapped.batch, window=9)))


def test_gemma3_through_the_engine_matches_transformers() -> None:
    """A tiny Gemma 3 (sliding layers of 8 positions) on the triton backend, through prefill
    chunks and decode steps, against transformers (tests/model/test_gemma3.py runs the others)."""
    from model.test_gemma3 import tiny_gemma3
    from model.test_llama_vs_hf import check_against

    from kvserve import LLM
    loaded, reference = tiny_gemma3(seed=4)
    llm = LLM(kv_format="native", loaded=loaded, block_size=4, max_num_batched_tokens=16, attention_backend="triton", device=DEVICE,
              num_kv_blocks=2000)
    check_against(llm, reference, [(i * 11) % 128 for i in range(21)], max_tokens=4)


def test_open_rows_of_full_last_blocks_are_ignored() -> None:
    """A full last block is read from its parts even when open_rows names a row (of garbage).
    (The reference overlays the row whenever open_rows >= 0, so it is run without it.)"""
    case = make_case("kivi2+out4", lens=[32, 20, 48], num_queries=[1, 3, 5], num_kv_heads=2, group=3,
                     block_size=16, device=DEVICE)
    ref = case.reference()
    b = case.batch
    named = replace(case, batch=replace(b, open_rows=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)))
    assert not torch.equal(named.reference(), ref)    # the rows hold garbage
    check(named, reference=ref)


def _poison(case: Case) -> Case:
    """Every byte a kernel must not read set to nan (float parts) or its codes to 0xff: blocks
    no table names (the tables' padding included), encoded parts of open blocks kept in
    residual rows, residual rows no sequence names, tokens past each sequence's end."""
    b, bs = case.batch, case.batch.block_size
    lens, opens = b.context_lens.tolist(), b.open_rows.tolist()
    num_blocks = next(iter(case.key.parts.values())).shape[0]
    used, open_blocks = set(), set()
    for s, length in enumerate(lens):
        blocks = b.block_tables[s, :-(-length // bs)].tolist()
        used.update(blocks)
        if length % bs:
            open_blocks.add((blocks[-1], length % bs, opens[s]))
    poison = torch.tensor(sorted(set(range(num_blocks)) - used), dtype=torch.long)
    poisoned_table = b.block_tables.clone()
    for s, length in enumerate(lens):
        poisoned_table[s, -(-length // bs):] = int(poison[0])

    def bad(t: torch.Tensor) -> float | int:
        return float("nan") if t.is_floating_point() else -1

    def half(store: HalfStore) -> HalfStore:
        parts = {n: t.clone() for n, t in store.parts.items()}
        residual = None if store.residual is None else torch.full_like(store.residual, float("nan"))
        for name, t in parts.items():
            t[poison.to(t.device)] = bad(t)
            for blk, filled, row in open_blocks:
                if store.residual is not None and row >= 0:
                    t[blk] = bad(t)                       # whole block lives in the residual row
                elif t.dim() >= 3 and t.shape[1] == bs and name not in ("scale", "zero") or \
                        name in ("scale", "zero") and store.layout.kind != CodecKind.ASYM_CHANNEL:
                    t[blk, filled:] = bad(t)              # per-token parts past the end
        if residual is not None:
            for s, length in enumerate(lens):
                if opens[s] >= 0:
                    residual[opens[s], :length % bs] = store.residual[opens[s], :length % bs]
        return HalfStore(store.layout, parts, residual)

    return replace(case, key=half(case.key), value=half(case.value), batch=replace(b, block_tables=poisoned_table))


@pytest.mark.parametrize("fmt", ["fp16", "int8", "fp8+had", "int4+out2", "kivi2", "kivi4+had+out4"])
def test_garbage_is_never_read(fmt: str) -> None:
    case = make_case(fmt, lens=[1, 16, 37], num_queries=[1, 4, 9], num_kv_heads=2, group=3, block_size=16,
                     device=DEVICE, seed=11)
    ref = case.reference()
    poisoned = _poison(case)
    out = run(poisoned)
    assert not out.isnan().any()
    check(case, out, ref)
    check(poisoned, run(poisoned, config=forced_splits(poisoned)), ref)


def test_out_argument_and_strided_query() -> None:
    case = matrix_case(("int8", None), "prefill", group=3, head_dim=64, block_size=16)
    qkv = torch.randn(case.q.shape[0], 3 * case.q.shape[1], case.q.shape[2], device=DEVICE)
    qkv[:, :case.q.shape[1]] = case.q
    strided = replace(case, q=qkv[:, :case.q.shape[1]])
    out = torch.full_like(case.q, float("nan"))
    assert run(strided, out=out) is out
    check(case, out)


def test_empty_sequences_and_batches() -> None:
    case = make_case("int8", lens=[10, 20], num_queries=[0, 2], num_kv_heads=2, group=3, device=DEVICE)
    check(case)
    q = case.q[:0]
    empty = replace(case, q=q, batch=replace(case.batch, query_starts=torch.zeros(3, dtype=torch.int32,
                                                                                   device=DEVICE)))
    assert run(empty).shape == q.shape


def _bad_layout(case: Case, **changes) -> Case:
    key = case.key
    layout = replace(key.layout, **changes)
    residual = torch.zeros(1, *key.parts["codes"].shape[1:3], case.q.shape[2]) if layout.encodes_whole_blocks \
        else key.residual
    return replace(case, key=HalfStore(layout, key.parts, residual))


def test_bad_inputs_raise() -> None:
    case = make_case("int4", lens=[20], num_queries=[1], num_kv_heads=2, group=3, head_dim=64, device=DEVICE)
    cases = {
        "packed codes of 3 bits": _bad_layout(case, bits=3),
        "group size 24 does not divide": _bad_layout(case, group_size=24),
        "expected dtype": _bad_layout(make_case("int8", lens=[20], num_queries=[1], device=DEVICE), kind=CodecKind.FP8),
        "missing part": _bad_layout(case, num_outliers=2),
        "unknown codec kind": _bad_layout(case, kind=7),
        "query heads are not a multiple": replace(case, q=case.q[:, :5]),
        "q must be float32": replace(case, q=case.q.double()),
        "int32 tensor": replace(case, batch=replace(case.batch, context_lens=case.batch.context_lens.long())),
        "expected shape": replace(case, batch=replace(case.batch, block_size=32)),
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            run(bad)
    odd = make_case("fp16", lens=[20], num_queries=[1], head_dim=48, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        run(replace(odd, key=HalfStore(replace(odd.key.layout, hadamard=True), odd.key.parts)))
    with pytest.raises(ValueError, match="out must match"):
        run(case, out=torch.empty_like(case.q, dtype=torch.float16))
    with pytest.raises(ValueError, match="tokens_per_split"):
        run(case, config=replace(tk.launch_config(case.q, case.batch, 2), tokens_per_split=24))


def test_kernel_kind_constants_are_the_layout_kinds() -> None:
    jit = sys.modules["kvserve.attention.triton_jit"]
    assert [int(getattr(jit, k.name).value) for k in CodecKind] == [int(k) for k in CodecKind]


def test_is_available_and_the_default_cut() -> None:
    assert tk.is_available()
    q = torch.empty(4, 9, 64)
    batch = PagedBatch(torch.zeros(4, 250, dtype=torch.int32), torch.full((4,), 4000, dtype=torch.int32),
                       torch.arange(5, dtype=torch.int32), torch.full((4,), -1, dtype=torch.int32), 16, 1, 4000)
    cfg = tk.launch_config(q, batch, 3)
    assert cfg.rows == 16 and cfg.tokens_per_split % 64 == 0
    assert cfg.num_splits == -(-4000 // cfg.tokens_per_split)



def test_the_benchmark_runs_in_the_interpreter() -> None:
    """kvserve.bench.attention_kernels_cuda end to end on a tiny shape (its numbers mean
    nothing here: it exists for a GPU), timing the host's side over 2 calls instead of 200."""
    if DEVICE != "cpu":
        pytest.skip("the benchmark itself runs on the GPU")
    from kvserve.bench import attention_kernels_cuda as bench

    text = bench.run(tk, ["int8", "kivi2"], ["smollm2-135m"], {"1x40": [40]}, 16, torch.bfloat16, "cpu", 2, 1 << 20,
                     host_calls=2)
    lines = text.splitlines()
    assert lines[0].startswith("device cpu") and len(lines) == 2 + 2 + 3
    assert all("x |" in line for line in lines[-3:-1])


def test_kernels_compile_for_the_gpu_without_spilling() -> None:
    """What the interpreter cannot show: the kernels compile for sm_90 (Triton's own ptxas, no
    GPU needed), keep their tiles in registers and ask well under an H100's 227 KB of shared
    memory, for the heaviest decode tile (2-bit per-channel keys, head_dim 128), a prefill
    with rotated outlier keys, mixed blocks (zip), the scoring kernel and a split decode (its
    merge in the kernel: an atomic ticket, a barrier)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = Path(__file__).with_name("compile_triton.py")
    variants = ["kivi2:bf16:128:decode", "k=fp8+had+out4,v=int4:fp16:64:prefill", "zip=int8/kivi2:bf16:128:prefill",
                "kivi2:bf16:128:score", "kivi2:bf16:128:split"]
    done = subprocess.run([sys.executable, str(script), "--arch", "90", "--variants", *variants], check=False,
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 5 and all("STACK:0" in line for line in lines), done.stdout
    assert all(int(line.split("smem:")[1].split()[0]) <= 128 * 1024 for line in lines), done.stdout


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("spec", ["fp32", "int8", "int4+had", "fp8"])
def test_scores_are_the_softmax_weights_each_key_gets(spec: str, split: bool) -> None:
    """``AttentionScores`` (what KV budgets score by), as the CPU kernel adds them: for each
    scored query (rows from ``score_from`` on; a sequence whose first scored row is past its
    queries: none) and query head, the softmax weight each visible key gets, added per KV head;
    the output unchanged bit for bit; through splits merged (each row's max and sum from the
    merge)."""
    from attention.cases import reference_scores

    from kvserve.kv.storage.layout import AttentionScores

    lens, queries, score_from = [300, 40, 37, 130], [1, 3, 1, 9], [0, 1, 1, 2]
    case = make_case(spec, lens=lens, num_queries=queries, group=3, num_kv_heads=2, device=DEVICE, seed=5)
    cfg = forced_splits(case, block_n=32) if split else tk.launch_config(case.q, case.batch, 2)
    plain = run(case, config=cfg)
    weights = torch.zeros(len(lens), 2, case.batch.max_context_len, device=DEVICE)
    scores = AttentionScores(weights, torch.tensor(score_from, dtype=torch.int32, device=DEVICE))
    assert torch.equal(run(case, config=cfg, scores=scores), plain)
    torch.testing.assert_close(weights.cpu(), reference_scores(case, score_from).cpu(), atol=2e-6, rtol=1e-5)


def test_scores_of_a_blend_chunk_and_of_the_open_block() -> None:
    """Queries at given positions (a chunk with gaps) see the keys up to their own; KIVI's open
    block is scored from its residual row."""
    from kvserve.kv.storage.layout import AttentionScores

    case = make_case("kivi2", lens=[45, 20], num_queries=[4, 2], group=2, num_kv_heads=1, device=DEVICE, seed=2)
    positions = torch.tensor([3, 17, 30, 44, 10, 19], dtype=torch.int32, device=DEVICE)
    case = replace(case, batch=replace(case.batch, query_positions=positions))
    weights = torch.zeros(2, 1, 45, device=DEVICE)
    scores = AttentionScores(weights, torch.tensor([1, 0], dtype=torch.int32, device=DEVICE))
    check(case, run(case, scores=scores))
    codec = case.key_codec     # the reference: every key as stored, the open block from its row
    for s, (start, rows) in enumerate(((0, range(1, 4)), (4, range(2)))):
        length = int(case.batch.context_lens[s])
        table = case.batch.block_tables[s, :-(-length // 16)].long()
        stored = codec.decode({n: t.index_select(0, table) for n, t in case.key.parts.items()}, torch.float32)
        stored = stored.flatten(0, 1)[:length].clone()
        if length % 16:
            row = int(case.batch.open_rows[s])
            stored[length - length % 16:] = case.key.residual[row, :length % 16].float()
        want = torch.zeros(45, dtype=torch.float64, device=DEVICE)
        for i in rows:
            visible = int(positions[start + i]) + 1
            q = case.q[start + i].double()                                  # [2 query heads, D]
            w = (q @ stored[:visible, 0].double().T * case.scale).softmax(-1)
            want[:visible] += w.sum(0)
        torch.testing.assert_close(weights[s, 0].double(), want, atol=2e-6, rtol=1e-5)


def test_a_layers_halves_are_prepared_once() -> None:
    """The backend checks a layer's halves and builds their arguments once (``prepare``), then
    hands them to every call; halves prepared for other keys, values or shapes are refused."""
    from kvserve.attention.backends import TritonBackend

    case = make_case("kivi2", lens=[40, 7], num_queries=[1, 1], group=2, num_kv_heads=2, device=DEVICE, seed=3)
    backend = TritonBackend()
    first = backend.attend(case.q, case.key, case.value, case.batch, case.scale)
    held = backend._layers.values()[0]
    assert torch.equal(backend.attend(case.q, case.key, case.value, case.batch, case.scale), first)
    assert backend._layers.values() == [held] and held.key is case.key and held.num_kv_heads == 2
    check(case, first)
    other = make_case("kivi2", lens=[40, 7], num_queries=[1, 1], group=2, num_kv_heads=2, device=DEVICE, seed=4)
    with pytest.raises(ValueError, match="prepared for other keys and values, head_dim or block size"):
        tk.paged_attention(case.q, case.key, other.value, case.batch, case.scale, halves=held)


def test_scores_are_checked() -> None:
    from kvserve.kv.storage.layout import AttentionScores

    case = make_case("fp32", lens=[40], num_queries=[1], group=1, num_kv_heads=2, device=DEVICE, seed=1)
    frm = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"scores.weights must be float32 \[1, 2, width\]"):
        run(case, scores=AttentionScores(torch.zeros(1, 3, 40, device=DEVICE), frm))
    with pytest.raises(ValueError, match="scores.score_from must be int32"):
        run(case, scores=AttentionScores(torch.zeros(1, 2, 40, device=DEVICE), frm.long()))


# precision by saliency (kv/storage/zip.py): a finer copy of the base, both Hadamard-rotated,
# a 16-bit copy, a finer format that encodes whole blocks over per-channel keys
ZIP_SPECS = ["zip:hi=int8,lo=kivi2g8,salient=0.5", "zip:hi=int8+had,lo=int4g8+had,salient=0.5",
             "zip:hi=fp16,lo=int2g8,salient=0.5", "zip:hi=int4g8+out2+had,lo=kivi4g8,salient=0.5"]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("spec", ZIP_SPECS)
def test_mixed_precision_blocks_are_read_in_the_precision_each_holds(spec: str, block_size: int) -> None:
    """Each full block read from its finer copy where it has one, else from its base parts (open
    blocks from their rows), against attention over what the storage's gather (the torch path)
    reads; tiles of whole blocks (block sizes 4 and 16) and inside one block (16, 8-key tiles).
    (Tiles that straddle blocks read each token's block the same way: storages' block sizes are
    powers of two, so one of tile and block divides the other.)"""
    from attention.cases import dense_attention, zip_case

    case = zip_case(spec, 64, block_size, DEVICE, seed=block_size, drop=[2, 5, 0])
    num_queries = [1, 3, 5]
    batch, starts = case.batch(num_queries)
    q = torch.randn(starts[-1], 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    scale = 64 ** -0.5
    config = tk.launch_config(q, batch, 2)
    for layer in (0, 1):
        key, value = case.storage.half_stores(layer)
        assert key.refined is not None and value.refined is not None
        got = tk.paged_attention(q, key, value, batch, scale, config=replace(config, block_n=8))
        keys, values = case.storage.gather(layer, batch.block_tables.long(), case.overlay)
        for s, length in enumerate(case.lens):
            ref = dense_attention(q[starts[s]:starts[s + 1]], keys[s], values[s], length, scale)
            torch.testing.assert_close(got[starts[s]:starts[s + 1]].double(), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(tk.paged_attention(q, key, value, batch, scale), got, atol=2e-5, rtol=2e-5)


def test_a_finer_copy_in_another_hadamard_domain_is_refused() -> None:
    from attention.cases import zip_case

    case = zip_case("zip:hi=int8,lo=kivi2g8+had,salient=0.5", 64, 4, DEVICE, seed=4, drop=[2, 5, 0])
    batch, _ = case.batch([1, 1, 1])
    with pytest.raises(ValueError, match="finer copy in its base's Hadamard domain only"):
        tk.paged_attention(torch.zeros(3, 4, 64, device=DEVICE), *case.storage.half_stores(0), batch, 0.125)


@pytest.mark.parametrize("fmt", ["native", "int8", "kivi2g8", "k=int4g8+had,v=fp8"])
def test_the_engine_on_the_triton_backend_gives_the_torch_paths_tokens(fmt: str) -> None:
    """The backend wired into the engine (on CPU through the interpreter): chunked prefills over
    cached context, decodes, a prefix hit and open blocks, on the tiny random model."""
    from tiny import tiny_model

    from kvserve import LLM, SamplingParams

    loaded = tiny_model()
    device = DEVICE
    prompts = [list(range(1, 40)), list(range(5, 25)), [3] * 17, list(range(1, 30))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=32, max_num_batched_tokens=24, device=device,
                  dtype="float32", attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [(o.token_ids, o.num_cached_tokens) for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
    assert outs["triton"] == outs["torch"]
    assert outs["triton"][3][1] == 16                   # the last prompt hit the first's leading block


@pytest.mark.parametrize("fmt", ["native", "int8"])
def test_decode_steps_through_graph_buckets_give_the_eager_tokens(fmt: str) -> None:
    """Decode steps through batch-size buckets (kvserve/engine/graphs.py) on the triton backend:
    each bucket's grid cut for any context (its batch's max_context_len is the table's capacity,
    so most splits lie past a sequence's end), its padding rows on the reserved block; captured
    and replayed on CUDA, run eagerly through the interpreter. The eager engine's tokens."""
    from tiny import tiny_model

    from kvserve import LLM, SamplingParams
    from kvserve.engine.graphs import DecodeGraphs

    prompts = [list(range(1, 40)), list(range(5, 25)), [3] * 17]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 6, 9)]
    outs = {}
    graphs = None
    for bucketed in (False, True):
        llm = LLM(loaded=tiny_model(), kv_format=fmt, num_kv_blocks=40, device=DEVICE, dtype="float32",
                  attention_backend="triton", max_num_seqs=4)
        eng = llm.engine
        if bucketed:
            graphs = DecodeGraphs(eng.model, eng.runner.cache, eng.runner.backend, eng.kv.reserve_block(),
                                  eng.kv.num_blocks_needed(eng.max_model_len), (1, 2, 4), capture=DEVICE == "cuda")
            eng.runner.graphs = graphs
        outs[bucketed] = [o.token_ids for o in llm.generate(prompts, params)]
        eng.check_integrity()
    assert outs[True] == outs[False]
    assert graphs is not None and (graphs.stats.eager_steps, graphs.stats.replayed_steps) == (1, 8)


@pytest.mark.parametrize("fmt", ["native", "int8", "kivi2g8"])
@pytest.mark.parametrize("policy", ["snapkv", "pyramid", "saliency-blocks"])
def test_budgeted_requests_on_the_triton_backend_give_the_torch_paths_tokens(policy: str, fmt: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A compacted request reads in place on the triton backend too: snapkv's slots as one plain
    sequence, pyramid's smaller layer through a block table that skips its hole, in the native
    format and quantized ones (KIVI's keys: the rewritten blocks encoded again), its decodes
    scored by the kernels (``AttentionScores``; the prefill's window on the torch path). Same
    tokens as the torch backend, through the compaction at the end of the prefill and one in
    decode."""
    from tiny import tiny_model

    from kvserve import LLM, SamplingParams
    from kvserve.attention import paged

    torch_scored = []                       # the queries the torch path scores, per call
    score = paged._score

    def counted(q: torch.Tensor, b: paged.BudgetedChunk, *args: object) -> None:
        rows = b.scored_rows if b.scored_rows is not None else range(b.first_scored_row, q.shape[0])
        if rows:
            torch_scored.append(len(rows))
        score(q, b, *args)

    monkeypatch.setattr(paged, "_score", counted)
    loaded = tiny_model()
    prompt = [(7 * i) % 120 + 1 for i in range(100)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, kv_budget=32, kv_policy=policy)
    outs, scored = {}, {}
    for backend in ("torch", "triton"):
        torch_scored.clear()
        llm = LLM(loaded=loaded, num_kv_blocks=32, max_num_batched_tokens=64, device=DEVICE, dtype="float32",
                  attention_backend=backend, kv_format=fmt)
        outs[backend] = llm.generate(prompt, params)[0].token_ids
        scored[backend] = list(torch_scored)
        assert llm.engine.kv.budgets.num_compactions == 2
        llm.engine.check_integrity()
    assert outs["triton"] == outs["torch"] and len(outs["torch"]) == 20
    assert scored["torch"] and 1 in scored["torch"] and 1 not in scored["triton"]   # decodes: in the kernel


@pytest.mark.parametrize("spec", ["zip:hi=int8,lo=kivi2g8,salient=0.3", "zip:hi=int8+had,lo=int4g8+had,salient=0.3"])
def test_a_zip_format_on_the_triton_backend_gives_the_torch_paths_tokens(spec: str) -> None:
    """Precision by saliency in the engine: blocks refined as they fill, the least salient losing
    their finer copy as the context grows (saliency from probes, scored by the kernels in decode),
    read in place by the kernel. Same tokens as the torch backend."""
    from tiny import tiny_model

    from kvserve import LLM, SamplingParams

    loaded = tiny_model()
    prompts = [[(7 * i) % 120 + 1 for i in range(90)], list(range(5, 45))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)     # 8: a copy dropped in decode too
    outs, dropped = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(loaded=loaded, kv_format=spec, num_kv_blocks=48, max_num_batched_tokens=32, device=DEVICE,
                  dtype="float32", attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        dropped[backend] = llm.engine.kv.budgets.num_dropped
        llm.engine.check_integrity()
    assert outs["triton"] == outs["torch"]
    assert dropped["triton"] == dropped["torch"] > 0


def test_a_saliency_budget_under_a_zip_format_on_the_triton_backend_gives_the_torch_paths_tokens() -> None:
    """A KV budget under precision by saliency: compactions write whole blocks, base and finer
    copy, and the kernels read the compacted slots of mixed blocks in place. Same tokens and the
    same copies dropped as the torch backend."""
    from tiny import tiny_model

    from kvserve import LLM, SamplingParams

    loaded = tiny_model()
    prompt = [(7 * i) % 120 + 1 for i in range(100)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, kv_budget=32, kv_policy="saliency-blocks")
    outs, dropped = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(loaded=loaded, kv_format="zip:hi=int8,lo=kivi2g8,salient=0.3", num_kv_blocks=32,
                  max_num_batched_tokens=64, device=DEVICE, dtype="float32", attention_backend=backend)
        outs[backend] = llm.generate(prompt, params)[0].token_ids
        budgets = llm.engine.kv.budgets
        assert budgets.num_compactions == 2
        dropped[backend] = budgets.num_dropped
        llm.engine.check_integrity()
    assert outs["triton"] == outs["torch"] and len(outs["torch"]) == 20
    assert dropped["triton"] == dropped["torch"] > 0


@pytest.mark.parametrize("fmt", ["native", "kivi2g8"])
def test_a_blend_in_the_batch_on_the_triton_backend_gives_the_torch_paths_tokens(fmt: str) -> None:
    """A blend's rows as chunks of the steps (``blend_in_batch``): one query sequence per run of
    computed rows, a run that stops inside a block reading it from the row the step writes it in
    (KIVI's keys), beside a plain request. Same tokens as the torch backend."""
    from tiny import random_tokens, tiny_model

    from kvserve import LLM, SamplingParams
    from kvserve.blend.prompt import Segment, SegmentedPrompt

    loaded = tiny_model()
    docs = [random_tokens(40, 1), random_tokens(33, 2)]
    prompt = SegmentedPrompt([random_tokens(11, 0), Segment(docs[0]), [5], Segment(docs[1]), [5],
                              random_tokens(7, 9)], blend_fraction=0.2)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=32, max_num_batched_tokens=12, device=DEVICE,
                  dtype="float32", attention_backend=backend, blend_in_batch=True, blend_cost_model=False)
        llm.cache_segments(docs)
        got = llm.generate([prompt, list(range(1, 30))], params)
        assert got[0].num_reused_tokens == 64
        outs[backend] = [o.token_ids for o in got]
        llm.engine.check_integrity()
    assert outs["triton"] == outs["torch"]
