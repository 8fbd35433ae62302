"""The C++ quantize-on-write (attention/cpu_writes.py, attention/csrc/encode.h) against the storages'
torch path: the same steps written both ways must leave the same bytes in every part and
residual row, in every format, compute dtype and instruction set."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch
from tiny import TINY

from kvserve.attention import cpu
from kvserve.attention.cpu_extension import load_extension, supported_isas
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.kv.codecs import fp8_supported, parse_kv_format
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.paged import PagedKVCache
from kvserve.kv.storage.quantized import QuantizedKVCache

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the C++ CPU extension cannot be built here")

CPU = torch.device("cpu")
BLOCK = 16
NUM_BLOCKS = 40
NUM_ROWS = 40
# Every kind, group sizes below / at / above the vector width, the options alone and combined,
# per-half and per-layer specs.
SPECS = ["native", "fp32", "fp16", "bf16", "fp8", "int8", "int4", "int4g8", "int4g16", "int4g64", "int2",
         "kivi4", "kivi2", "kivi2g64", "int8+had", "fp8+had", "int4+had", "kivi2+had", "int8+out4", "fp8+out2",
         "int4+out4", "kivi2+out4", "kivi4+had+out4", "int8+had+out2", "fp8+had+out2", "k=int8,v=int4",
         "k=kivi4+had,v=bf16", "k=kivi2+out4,v=kivi2", "0=fp16;1=kivi2+had"]
# (sequence, new tokens) per step: prompts ending in an open block and on a block boundary,
# decodes, chunks that fill a block mid-chunk, one long enough for the threaded path.
STEPS = [[("a", 37), ("b", 16)],
         [("a", 1), ("b", 1), ("c", 20)],
         [("a", 12), ("b", 1), ("c", 12)],
         [("a", 1), ("b", 1), ("c", 1), ("d", 300)],
         [("a", 1), ("b", 15), ("c", 1), ("d", 1)]]


@dataclass(frozen=True)
class Shape:
    kv_heads: int = 3
    head_dim: int = 64


def skip_without_fp8(spec: str) -> None:
    if "fp8" in spec and not fp8_supported():
        pytest.skip(f"torch {torch.__version__} has no float8_e4m3fn")


def make_storage(spec: str, dtype: torch.dtype, shape: Shape, *, cpu_writes: bool) -> KVStorage:
    config = dataclasses.replace(TINY, num_kv_heads=shape.kv_heads, num_heads=shape.kv_heads,
                                 head_dim=shape.head_dim)
    fmt = parse_kv_format(spec, config.num_layers, dtype, head_dim=shape.head_dim)
    writer = CpuWrites.for_storage if cpu_writes else None
    if fmt.is_lossless:
        return PagedKVCache(config, NUM_BLOCKS, BLOCK, dtype, CPU, make_writer=writer)
    return QuantizedKVCache(config, NUM_BLOCKS, BLOCK, fmt, NUM_ROWS, dtype, CPU, make_writer=writer)


def new_tokens(n: int, shape: Shape, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of n tokens, strided views of a fused qkv row as the model hands them
    over, with the rows a codec finds awkward: an outlier channel, all zeros, a constant row,
    values whose float16 scales are subnormal, large values, exact ties, one spike."""
    h, d = shape.kv_heads, shape.head_dim
    qkv = torch.randn(n, 3 * h * d, generator=g)
    k = qkv[:, h * d:2 * h * d].view(n, h, d)
    v = qkv[:, 2 * h * d:].view(n, h, d)
    k[:, :, 1] *= 8
    k *= torch.exp(torch.randn(n, h, 1, generator=g))
    special = [torch.zeros(d), torch.full((d,), 0.37), torch.randn(d, generator=g) * 1e-6,
               torch.randn(d, generator=g) * 2e3, torch.randint(-3, 4, (d,), generator=g).float(),
               torch.cat([torch.tensor([6e4]), torch.randn(d - 1, generator=g) * 1e-3])]
    picks = torch.randint(len(special), (n,), generator=g).tolist()
    for i in range(n):
        if i % 3 == 0:
            (k if i % 2 else v)[i, i % h] = special[picks[i]]
    qkv = qkv.to(dtype)
    return qkv[:, h * d:2 * h * d].view(n, h, d), qkv[:, 2 * h * d:].view(n, h, d)


def assert_same_bytes(reference: KVStorage, tested: KVStorage) -> None:
    for layer in range(reference.num_layers):
        for ref, new, half in zip(reference.half_stores(layer), tested.half_stores(layer), ("key", "value")):
            for name, t in ref.parts.items():
                same = torch.equal(t.view(torch.uint8), new.parts[name].view(torch.uint8))
                assert same, f"layer {layer} {half} {name}: {differences(t, new.parts[name])}"
            if ref.residual is not None:
                assert new.residual is not None
                assert torch.equal(ref.residual.view(torch.uint8), new.residual.view(torch.uint8)), \
                    f"layer {layer} {half} residual rows differ"


def differences(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
    return f"{diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"


def run_steps(reference: KVStorage, tested: KVStorage, writer: CpuWrites | None, shape: Shape, dtype: torch.dtype,
              seed: int = 0) -> None:
    """Write STEPS into both storages (``tested`` through ``writer``, else its own ``write``),
    comparing every byte after each step."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    for step in STEPS:
        planners = [s.planner() for s in (reference, tested)]
        for name, n in step:
            table = tables.setdefault(name, [])
            start = lens.get(name, 0)
            while len(table) * BLOCK < start + n:
                table.append(free.pop())
            for p in planners:
                p.add(table, start, n)
            lens[name] = start + n
        w_ref, w_new = (p.build() for p in planners)
        for layer in range(reference.num_layers):
            k, v = new_tokens(w_ref.slots.numel(), shape, dtype, g)
            reference.write(layer, k, v, w_ref)
            if writer is None:
                tested.write(layer, k, v, w_new)
            else:
                writer.write(layer, k, v, w_new.slots, w_new.residual_slots, w_new.encode_rows, w_new.encode_block_ids)
        reference.finish_step(w_ref)
        tested.finish_step(w_new)
        assert_same_bytes(reference, tested)


def halves(storage: KVStorage):
    return [storage.half_stores(layer) for layer in range(storage.num_layers)]


@pytest.mark.parametrize("spec", SPECS)
def test_every_format_writes_the_torch_paths_bytes(spec: str) -> None:
    skip_without_fp8(spec)
    shape = Shape()
    reference = make_storage(spec, torch.float32, shape, cpu_writes=False)
    tested = make_storage(spec, torch.float32, shape, cpu_writes=True)
    calls = []
    writer = CpuWrites.for_storage(CPU, halves(tested), shape.head_dim)
    assert writer is not None
    original = writer.write

    def counting(*args, **kwargs):
        calls.append(args[0])
        original(*args, **kwargs)

    writer.write = counting  # type: ignore[method-assign]
    run_steps(reference, tested, writer, shape, torch.float32)
    assert len(calls) == len(STEPS) * reference.num_layers      # one call per layer, both halves
    # and through the storage's own write (the engine's path)
    again = make_storage(spec, torch.float32, shape, cpu_writes=True)
    run_steps(make_storage(spec, torch.float32, shape, cpu_writes=False), again, None, shape, torch.float32, seed=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["native", "fp32", "fp16", "bf16", "fp8", "int8", "int4g16", "kivi2", "int8+had",
                                  "kivi4+had+out4", "int4+out4"])
def test_half_precision_compute_dtypes(spec: str, dtype: torch.dtype) -> None:
    skip_without_fp8(spec)
    shape = Shape(kv_heads=2)
    run_steps(make_storage(spec, dtype, shape, cpu_writes=False), make_storage(spec, dtype, shape, cpu_writes=True),
              None, shape, dtype)


@pytest.mark.parametrize("head_dim", [16, 32, 128, 256])
@pytest.mark.parametrize("spec", ["int8+had", "fp8+had+out2", "kivi2g8+had+out4", "int4g8+had", "int2g16+out4"])
def test_head_dims(spec: str, head_dim: int) -> None:
    # the Hadamard stages and their 1/sqrt(D) at every size, outliers up to 256 channels
    skip_without_fp8(spec)
    shape = Shape(kv_heads=1, head_dim=head_dim)
    run_steps(make_storage(spec, torch.float32, shape, cpu_writes=False),
              make_storage(spec, torch.float32, shape, cpu_writes=True), None, shape, torch.float32)


@pytest.mark.parametrize("isa", [isa for isa in ("avx2", "scalar") if isa in supported_isas()])
@pytest.mark.parametrize("spec", ["native", "bf16", "fp16", "fp8", "int8", "int4g8", "int4", "kivi2",
                                  "kivi4+had+out4", "fp8+had+out2", "int2g16+out4"])
def test_narrower_builds_write_the_same_bytes(spec: str, isa: str) -> None:
    skip_without_fp8(spec)
    ext = load_extension(isa)
    assert ext is not None and ext.isa == isa
    # 40 channels: rows end in a partial vector (formats without groups or rotation)
    shape = Shape(kv_heads=2, head_dim=40 if spec in ("native", "bf16", "fp16", "fp8", "int8") else 64)
    for dtype in (torch.float32, torch.bfloat16):
        tested = make_storage(spec, dtype, shape, cpu_writes=False)
        writer = CpuWrites(ext, halves(tested), shape.head_dim)
        run_steps(make_storage(spec, dtype, shape, cpu_writes=False), tested, writer, shape, dtype)


def test_budget_writes_go_through_the_extension() -> None:
    # KV budgets rewrite entries at any slot (write_slots): the same bytes both ways
    shape = Shape()
    torch_path, kernel = (make_storage("native", torch.float32, shape, cpu_writes=w) for w in (False, True))
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, 77, 3, 600, 301])
    k, v = new_tokens(5, shape, torch.float32, g)
    for s in (torch_path, kernel):
        s.write_slots(1, k, v, slots)
    assert_same_bytes(torch_path, kernel)


def test_bad_writes_are_clear_errors() -> None:
    shape = Shape()
    storage = make_storage("kivi2", torch.float32, shape, cpu_writes=False)
    writer = CpuWrites.for_storage(CPU, halves(storage), shape.head_dim)
    assert writer is not None
    k = torch.zeros(2, 3, 64)
    ok = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"slots\[1\] = 640 is outside \[0, 640\)"):
        writer.write(0, k, k, torch.tensor([0, 640]), ok)
    with pytest.raises(ValueError, match=r"residual_slots\[0\] = -1"):
        writer.write(0, k, k, ok, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="value must have shape"):
        writer.write(0, k, torch.zeros(2, 3, 32), ok, ok)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        writer.write(0, k.double(), k.double(), ok, ok)
    with pytest.raises(ValueError, match="encode_rows and encode_block_ids differ"):
        writer.write(0, k, k, ok, ok, torch.tensor([0]), torch.tensor([0, 1]))


@pytest.mark.parametrize("spec", ["kivi2", "int8", "k=kivi2+out4,v=kivi2", "0=fp16;1=kivi2+had", "int4+out4"])
def test_budget_rewrites_through_the_writer_are_the_torch_paths_bytes(spec: str) -> None:
    """A KV budget's rewrite (``write_slots``) through the C++ writer leaves the bytes of the
    codecs' torch path: whole closed blocks, one partly written (its other tokens decoded into
    the borrowed row first), an open block's front in its row (``reopen``), and more closed
    blocks than free rows (written in groups of the rows lent), the slots in any order."""
    shape, dtype = Shape(), torch.float32
    reference = make_storage(spec, dtype, shape, cpu_writes=False)
    tested = make_storage(spec, dtype, shape, cpu_writes=True)
    g = torch.Generator().manual_seed(3)
    for storage in (reference, tested):         # blocks 0-11 full, the same tokens in both
        planner = storage.planner()
        planner.add(list(range(12)), 0, 12 * BLOCK)
        writes = planner.build()
        g.manual_seed(3)
        for layer in range(storage.num_layers):
            storage.write(layer, *new_tokens(12 * BLOCK, shape, dtype, g), writes)
        storage.finish_step(writes)
    assert_same_bytes(reference, tested)
    lent = [s.residual.borrow(s.residual.num_free_rows - 2) if s.residual.num_rows else [] for s in (reference, tested)]
    slots = torch.cat([torch.arange(1 * BLOCK, 6 * BLOCK),            # blocks 1-5, whole
                       torch.arange(6 * BLOCK, 6 * BLOCK + 5),        # block 6, its first 5 slots
                       torch.arange(12 * BLOCK, 12 * BLOCK + 7)])     # block 12, open again
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    for storage in (reference, tested):
        storage.reopen(12)
    for layer in range(reference.num_layers):
        k, v = new_tokens(slots.numel(), shape, dtype, g)
        for storage in (reference, tested):
            storage.write_slots(layer, k, v, slots)
    # every part, and the open block's row (the writer's borrowed rows are scratch: free again)
    row = reference.residual.row_of(12)
    assert row == tested.residual.row_of(12) and (row is None) == (reference.residual.num_rows == 0)
    for layer in range(reference.num_layers):
        for ref, new in zip(reference.half_stores(layer), tested.half_stores(layer)):
            for name, t in ref.parts.items():
                assert torch.equal(t.view(torch.uint8), new.parts[name].view(torch.uint8)), differences(t, new.parts[name])
            if ref.residual is not None:
                assert new.residual is not None and torch.equal(ref.residual[row], new.residual[row])
    for storage, rows in zip((reference, tested), lent):
        storage.residual.give_back(rows)
        if storage.residual.num_rows:
            storage.residual.release([12])
        storage.residual.check_integrity()
