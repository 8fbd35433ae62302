"""Micro-benchmark of the Triton paged-attention kernels (decode) on a CUDA GPU.

    python -m kvserve.bench.attention_kernels_cuda [--formats native,int8,kivi2] [--repeats 50]
    python -m kvserve.bench.attention_kernels_cuda --interpret     # no GPU: a tiny shape on CPU

Workloads: decode with 4 sequences of 4,000 tokens and 1 sequence of 8,000, for SmolLM2-135M's
attention (3 KV heads, 9 query heads, head_dim 64) and Llama-3-8B's (8 KV heads, 32 query
heads, head_dim 128), block size 16, compute dtype bfloat16 (``--dtype``), one layer. For
each KV format, in the same run and on the same inputs:

* ``triton``  the triton attention backend (kvserve.attention.backends.TritonBackend, as the
              engine calls it: the layer's halves checked and their arguments built once),
              reading the blocks in place;
* ``paged``   the torch path: gather the blocks (index_select of every part) + codec.decode
              to the compute dtype + scaled_dot_product_attention (what kvserve.attention.paged
              does per decode step);
* ``sdpa``    scaled_dot_product_attention on a contiguous bf16 cache [S, H, L, D] (the
              speed reference: FlashAttention where torch picks it), the group's query heads
              as rows so that no K/V is repeated.

Each call is timed alone with CUDA events after the L2 cache is flushed (a model's layers
read different KV, so a step never finds its KV in L2); the call is queued behind the
256 MB flush, so host-side launch time is hidden unless it exceeds the flush (~0.1 ms; the
paged path's many small ops may). The table gives the median of ``--repeats`` calls and the
10-90 percentile spread; speedups are ratios of medians (paged or sdpa time / triton time). GB/s counts the bytes a call must read
(the KV format's stored bytes of the context, q and out) over the median time, against the
device's bandwidth measured in the same run by a 1 GiB device-to-device copy (read + write
bytes / time). *host us* is what the host spends issuing one triton call (200 calls back to
back, no synchronization between them, the device running behind), through the backend and,
for comparison, through ``paged_attention`` unprepared (every call checking the halves and
building their arguments): where it exceeds the device time, the host is the bound. *prepare
us* is that checking and building alone (``triton_kernels.prepare``, median of 200 calls: host
work, a real measurement under ``--interpret`` too), which the backend does once per layer.
``--interpret`` checks the benchmark itself (wall-clock timing, tiny shapes): its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from kvserve.bench.common import table
from kvserve.kv.codecs import HalfCodec, parse_codec
from kvserve.kv.storage.layout import HalfLayout, HalfStore, PagedBatch

SHAPES = {"smollm2-135m": (3, 9, 64), "llama3-8b": (8, 32, 128)}   # KV heads, query heads, head_dim
WORKLOADS = {"4x4000": [4000] * 4, "1x8000": [8000]}
FORMATS = "native,fp8,int8,int4,kivi4,kivi2,int8+had,kivi2+out4"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Cache:
    """One layer's paged cache in one format, the same tokens laid out contiguously for SDPA."""

    key_codec: HalfCodec
    value_codec: HalfCodec
    key: HalfStore
    value: HalfStore
    batch: PagedBatch
    q: torch.Tensor              # [S, Hq, D]
    contiguous_k: torch.Tensor   # [S, H, L, D] in the compute dtype (equal lengths)
    contiguous_v: torch.Tensor
    kv_nbytes: int               # bytes of the stored parts the sequences' blocks hold


def _store(codec: HalfCodec, blocks: torch.Tensor, rows: int) -> HalfStore:
    layout = HalfLayout.from_codec(codec)
    residual = torch.zeros(rows, *blocks.shape[1:], dtype=blocks.dtype, device=blocks.device) \
        if layout.encodes_whole_blocks else None
    return HalfStore(layout, {n: t.contiguous() for n, t in codec.encode(blocks).items()}, residual)


def build(fmt: str, lens: list[int], shape: tuple[int, int, int], block_size: int, dtype: torch.dtype,
          device: str, seed: int = 0) -> Cache:
    if len(set(lens)) != 1:
        raise ValueError(f"the benchmark's sequences have equal lengths, got {lens}")
    heads, q_heads, dim = shape
    g = torch.Generator(device=device).manual_seed(seed)
    key_codec, value_codec = parse_codec(fmt, "k", dtype), parse_codec(fmt, "v", dtype)
    num_blocks = len(lens) * -(-lens[0] // block_size)
    tables = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32).view(len(lens), -1)  # scattered
    k = torch.randn(num_blocks, block_size, heads, dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(num_blocks, block_size, heads, dim, generator=g, device=device, dtype=dtype)
    key, value = _store(key_codec, k, len(lens)), _store(value_codec, v, len(lens))
    # token t of sequence s is row t of its blocks in table order
    order = tables.long().reshape(-1)
    contiguous_k = k[order].view(len(lens), -1, heads, dim)[:, :lens[0]].transpose(1, 2).contiguous()
    contiguous_v = v[order].view(len(lens), -1, heads, dim)[:, :lens[0]].transpose(1, 2).contiguous()
    batch = PagedBatch(tables.contiguous(), torch.tensor(lens, dtype=torch.int32, device=device),
                       torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
                       torch.full((len(lens),), -1, dtype=torch.int32, device=device), block_size, 1, max(lens))
    q = torch.randn(len(lens), q_heads, dim, generator=g, device=device, dtype=dtype)
    kv_nbytes = num_blocks * (key_codec.nbytes_per_block(block_size, heads, dim)
                              + value_codec.nbytes_per_block(block_size, heads, dim))
    return Cache(key_codec, value_codec, key, value, batch, q, contiguous_k, contiguous_v, kv_nbytes)


def torch_paged(c: Cache, scale: float) -> torch.Tensor:
    """gather + codec.decode + SDPA, as the torch backend reads a decode step."""
    seqs, q_heads, dim = c.q.shape
    heads = c.contiguous_k.shape[1]
    flat = c.batch.block_tables.reshape(-1)
    kd = c.key_codec.decode({n: t.index_select(0, flat) for n, t in c.key.parts.items()}, c.q.dtype)
    vd = c.value_codec.decode({n: t.index_select(0, flat) for n, t in c.value.parts.items()}, c.q.dtype)
    kd = kd.view(seqs, -1, heads, dim).transpose(1, 2)
    vd = vd.view(seqs, -1, heads, dim).transpose(1, 2)
    keys = torch.arange(kd.shape[2], device=c.q.device)
    mask = (keys[None, :] < c.batch.context_lens[:, None]).view(seqs, 1, 1, -1)
    o = F.scaled_dot_product_attention(c.q.view(seqs, heads, q_heads // heads, dim), kd, vd, attn_mask=mask,
                                       scale=scale)
    return o.reshape(seqs, q_heads, dim)


def contiguous_sdpa(c: Cache, scale: float) -> torch.Tensor:
    seqs, q_heads, dim = c.q.shape
    heads = c.contiguous_k.shape[1]
    o = F.scaled_dot_product_attention(c.q.view(seqs, heads, q_heads // heads, dim), c.contiguous_k,
                                       c.contiguous_v, scale=scale)
    return o.reshape(seqs, q_heads, dim)


class Timer:
    """Times one call at a time: CUDA events after an L2 flush, or the wall clock on CPU."""

    def __init__(self, device: str, flush_bytes: int = 256 << 20, warmup: int = 3) -> None:
        self.cuda = device == "cuda"
        self.flush = torch.empty(flush_bytes // 4 if self.cuda else 1, dtype=torch.float32, device=device)
        self.warmup = warmup

    def times(self, fn: Callable[[], object], repeats: int) -> list[float]:
        for _ in range(self.warmup):
            fn()
        out = []
        for _ in range(repeats):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        return out


def copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of ``repeats``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = Timer(device, flush_bytes=4).times(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / statistics.median(times)


def spread(times: list[float]) -> str:
    """median in microseconds with the 10-90 percentile range."""
    qs = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return f"{statistics.median(times) * 1e6:.1f} ({qs[0] * 1e6:.0f}-{qs[-1] * 1e6:.0f})"


def host_time(fn: Callable[[], object], cuda: bool, calls: int = 200) -> float:
    """Seconds the host spends issuing one call of ``fn``: ``calls`` back to back, the device
    synchronized only before and after."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    if cuda:
        torch.cuda.synchronize()
    return elapsed / calls


def measure(kernels: ModuleType, c: Cache, scale: float, timer: Timer, repeats: int, host_calls: int = 200
            ) -> tuple[list[float], list[float], float, tuple[float, float, float]]:
    """(triton times, paged times, max |triton - paged|, host seconds per triton call through
    the backend and unprepared, and of ``prepare``, each from ``host_calls`` calls) of one cache's
    decode step."""
    from kvserve.attention.backends import TritonBackend

    out = torch.empty_like(c.q)
    triton_call = partial(TritonBackend().attend, c.q, c.key, c.value, c.batch, scale, out)
    unprepared = partial(kernels.paged_attention, c.q, c.key, c.value, c.batch, scale, out=out)
    paged_call = partial(torch_paged, c, scale)
    err = (triton_call().float() - paged_call().float()).abs().max().item()
    host = (host_time(triton_call, timer.cuda, host_calls), host_time(unprepared, timer.cuda, host_calls))
    prepare = partial(kernels.prepare, c.key, c.value, c.q.shape[2], c.batch.block_size)
    prepared = statistics.median(host_time(prepare, False, calls=1) for _ in range(host_calls))
    return timer.times(triton_call, repeats), timer.times(paged_call, repeats), err, (*host, prepared)


def run(kernels: ModuleType, formats: list[str], shapes: list[str], workloads: dict[str, list[int]],
        block_size: int, dtype: torch.dtype, device: str, repeats: int, copy_bytes: int,
        host_calls: int = 200) -> str:
    bandwidth = copy_bandwidth(device, copy_bytes, max(5, repeats // 5))
    timer = Timer(device, warmup=3 if device == "cuda" else 1)
    med = statistics.median
    rows: list[list[object]] = []
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        scale = shape[2] ** -0.5
        for work_name, lens in workloads.items():
            sdpa: list[float] = []
            for fmt in formats:
                c = build(fmt, lens, shape, block_size, dtype, device)
                t_triton, t_paged, err, host = measure(kernels, c, scale, timer, repeats, host_calls)
                sdpa = sdpa or timer.times(partial(contiguous_sdpa, c, scale), repeats)
                rate = (c.kv_nbytes + 2 * c.q.numel() * c.q.element_size()) / med(t_triton)
                splits = kernels.launch_config(c.q, c.batch, shape[0]).num_splits
                rows.append([shape_name, work_name, fmt, f"{c.kv_nbytes / 1e6:.2f}", splits, spread(t_triton),
                             f"{rate / 1e9:.0f}", f"{100 * rate / bandwidth:.0f}%", spread(t_paged),
                             f"{med(t_paged) / med(t_triton):.2f}x", f"{med(sdpa) / med(t_triton):.2f}x", f"{err:.1e}",
                             f"{host[0] * 1e6:.0f} / {host[1] * 1e6:.0f}", f"{host[2] * 1e6:.1f}"])
            sdpa_bytes = 2 * len(lens) * lens[0] * shape[0] * shape[2] * 2
            rows.append([shape_name, work_name, "sdpa contiguous bf16", f"{sdpa_bytes / 1e6:.2f}", "", spread(sdpa),
                         f"{sdpa_bytes / med(sdpa) / 1e9:.0f}", f"{100 * sdpa_bytes / med(sdpa) / bandwidth:.0f}%",
                         "", "", "1.00x", "", "", ""])
    header = (f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter)'}, "
              f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, dtype {dtype}, block size {block_size}, "
              f"median of {repeats} calls (p10-p90), L2 flushed before each")
    return header + "\n\n" + table(
        ["shape", "decode", "format", "KV MB", "splits", "triton us", "GB/s", "of copy", "paged us",
         "speedup vs paged", "speedup vs sdpa", "max |triton - paged|", "host us (unprepared)",
         "prepare us"], rows)


def load_kernels(interpret: bool) -> ModuleType:
    """kvserve.attention.triton_kernels; with ``interpret`` its kernels (and triton itself)
    decorated for Triton's interpreter, which must happen before triton is first imported."""
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from kvserve.attention import triton_kernels
    if interpret and not triton_kernels.is_interpreted():
        raise RuntimeError("--interpret: triton was imported before TRITON_INTERPRET=1 could be set")
    if not triton_kernels.is_available():
        raise SystemExit("Triton kernels unavailable: install triton, and run on a CUDA GPU (or pass --interpret)")
    return triton_kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=FORMATS, help=f"comma-separated KV formats (default {FORMATS})")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--copy-gib", type=float, default=1.0, help="size of the bandwidth-measuring copy")
    p.add_argument("--interpret", action="store_true",
                   help="no GPU: run tiny shapes on CPU through Triton's interpreter (checks the benchmark runs)")
    args = p.parse_args(argv)
    kernels = load_kernels(args.interpret)
    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    device = "cuda"
    copy_bytes, host_calls = int(args.copy_gib * (1 << 30)), 200
    if args.interpret:
        device, copy_bytes, host_calls = "cpu", 16 << 20, 2
        workloads = {"2x40": [40, 40], "1x64": [64]}
        args.repeats = min(args.repeats, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --interpret to check the benchmark on CPU")
    print(run(kernels, args.formats.split(","), args.shapes.split(","), workloads, args.block_size,
              DTYPES[args.dtype], device, args.repeats, copy_bytes, host_calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
