"""Micro-benchmark of the attention kernels: one decode step's attention, per KV format.

    python -m kvserve.bench.attention_kernels [--formats fp32,int8] [--layers 30] [--repeats 15]
                                              [--model-shape qwen2.5-1.5b]

A model's attention shape (default SmolLM2-135M's: 3 KV heads, 9 query heads, head_dim 64,
block 16; ``--model-shape`` picks another from SHAPES), decode (one query per sequence) over
S sequences of N cached tokens each (default 4 x 4,000, and 1 x 8,192). Each format gets ``--layers`` separate caches (a model's layers), called in
turn, so the KV bytes come from memory as in a real step, not from the last level cache.

Per format: time per call of the C++ CPU kernel (kvserve.attention.cpu) and of the torch
path kvserve uses today (index_select of the blocks, codec.decode, scaled_dot_product_attention),
on the same inputs; the KV bytes one call reads and the kernel's effective GB/s next to the
machine's read bandwidth measured in the same run (a multi-threaded torch sum over a large
buffer). Times are medians over ``--repeats`` sweeps of all layers, with the min-max spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention import cpu
from kvserve.bench.common import table
from kvserve.kv.codecs import HalfCodec, parse_codec
from kvserve.kv.storage.layout import HalfLayout, HalfStore, PagedBatch

DEFAULT_FORMATS = ("fp32", "fp16", "int8", "fp8", "int4", "kivi4", "kivi2")


@dataclass(frozen=True)
class Shape:
    """One layer's attention: KV heads, query heads per KV head, head dim, tokens per block."""

    kv_heads: int
    group: int
    head_dim: int
    block_size: int = 16


SHAPES = {
    "smollm2-135m": Shape(3, 3, 64),
    "qwen2.5-1.5b": Shape(2, 6, 128),
    "qwen2.5-0.5b": Shape(2, 7, 64),
    "gemma-3-270m": Shape(1, 4, 256),
    "llama-3-8b": Shape(8, 4, 128),
}


@dataclass(frozen=True)
class Layer:
    key: HalfStore
    value: HalfStore


@dataclass(frozen=True)
class Stat:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, xs: list[float]) -> Stat:
        return cls(statistics.median(xs), min(xs), max(xs))


def build_half(codec: HalfCodec, shape: Shape, num_blocks: int, num_layers: int,
               g: torch.Generator) -> list[HalfStore]:
    """``num_layers`` independent copies (distinct memory) of one random encoded pool."""
    dims = (shape.block_size, shape.kv_heads, shape.head_dim)
    x = torch.randn(num_blocks, *dims, generator=g)
    x[..., 1] *= 8                                     # an outlier channel, as real keys have
    parts = {n: t.contiguous() for n, t in codec.encode(x).items()}
    layout = HalfLayout.from_codec(codec)
    residual = torch.zeros(4, *dims) if layout.encodes_whole_blocks else None
    return [HalfStore(layout, {n: t.clone() for n, t in parts.items()}, residual) for _ in range(num_layers)]


def torch_path(q: torch.Tensor, shape: Shape, kc: HalfCodec, vc: HalfCodec, layer: Layer,
               table_long: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """What kvserve's torch backend does for a decode batch (model/attention.py, kv/*_cache.py)."""
    flat = table_long.reshape(-1)
    num = table_long.shape[0]
    halves = []
    for codec, store in ((kc, layer.key), (vc, layer.value)):
        blocks = codec.decode({n: t.index_select(0, flat) for n, t in store.parts.items()}, torch.float32)
        halves.append(blocks.view(num, -1, shape.kv_heads, shape.head_dim).transpose(1, 2))
    qd = q.view(num, shape.kv_heads, shape.group, shape.head_dim)
    o = F.scaled_dot_product_attention(qd, halves[0], halves[1], attn_mask=mask, scale=scale)
    return o.reshape(num, shape.kv_heads * shape.group, shape.head_dim)


def read_bandwidth(nbytes: int, repeats: int) -> Stat:
    """GB/s of a multi-threaded torch sum over ``nbytes`` of float32 (far larger than the caches)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    return Stat.of(rates)


def sweep_times(fns: list[Callable[[int], object]], num_layers: int, repeats: int) -> list[tuple[Stat, Stat]]:
    """Per-call (wall, CPU) seconds of each fn(layer): each sample is one sweep of every layer;
    the fns take turns so drift in machine load falls on all of them. CPU time is this
    process's, all threads: it does not grow when other processes take the cores away."""
    for fn in fns:
        fn(0)
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, wall, cpu_ in zip(fns, walls, cpus):
            t, c = time.perf_counter(), time.process_time()
            for i in range(num_layers):
                fn(i)
            wall.append((time.perf_counter() - t) / num_layers)
            cpu_.append((time.process_time() - c) / num_layers)
    return [(Stat.of(w), Stat.of(c)) for w, c in zip(walls, cpus)]


def bench_format(token: str, shape: Shape, num_seqs: int, context: int, num_layers: int, repeats: int,
                 seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    kc, vc = parse_codec(token, "k", torch.float32), parse_codec(token, "v", torch.float32)
    block = shape.block_size
    blocks_per_seq = -(-context // block)
    num_blocks = num_seqs * blocks_per_seq
    keys = build_half(kc, shape, num_blocks, num_layers, g)
    values = build_half(vc, shape, num_blocks, num_layers, g)
    layers = [Layer(k, v) for k, v in zip(keys, values)]
    order = torch.randperm(num_blocks, generator=g)
    table32 = order.view(num_seqs, blocks_per_seq).to(torch.int32).contiguous()
    table_long = table32.long()
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    batch = PagedBatch(table32, lens, torch.arange(num_seqs + 1, dtype=torch.int32),
                       torch.full((num_seqs,), -1, dtype=torch.int32), block, 1, context)
    mask = (torch.arange(blocks_per_seq * block)[None, :] < lens[:, None])[:, None, None, :]
    q = torch.randn(num_seqs, shape.kv_heads * shape.group, shape.head_dim, generator=g)
    scale = shape.head_dim ** -0.5
    out = torch.empty_like(q)

    def kernel(i: int) -> object:
        return cpu.paged_attention(q, layers[i].key, layers[i].value, batch, scale, out=out)

    def baseline(i: int) -> object:
        return torch_path(q, shape, kc, vc, layers[i], table_long, mask, scale)

    diff = (kernel(0) - baseline(0)).abs().max().item()  # type: ignore[operator]
    (t_kernel, c_kernel), (t_torch, _) = sweep_times([kernel, baseline], num_layers, repeats)
    dims = (block, shape.kv_heads, shape.head_dim)
    nbytes = num_blocks * (kc.nbytes_per_block(*dims) + vc.nbytes_per_block(*dims))
    return {"format": kc.name if kc.name == vc.name else f"k={kc.name},v={vc.name}", "kernel": t_kernel,
            "kernel_cpu": c_kernel, "torch": t_torch, "nbytes": nbytes, "diff": diff}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated KV format tokens")
    p.add_argument("--shapes", default="4x4000,1x8192", help="comma-separated SEQSxTOKENS decode shapes")
    p.add_argument("--layers", type=int, default=30, help="separate caches per format, called in turn")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="smollm2-135m",
                   help="whose attention shape (KV heads, query heads per KV head, head dim)")
    args = p.parse_args(argv)
    shape = SHAPES[args.model_shape]
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.is_available():
        raise SystemExit("the C++ CPU attention kernel is unavailable (see the log line above)")
    load_before = os.getloadavg()
    bandwidth = read_bandwidth(1 << 30, args.repeats)
    print(f"shape: {args.model_shape}, {shape.kv_heads} KV heads x {shape.group} query heads, head_dim "
          f"{shape.head_dim}, block {shape.block_size}")
    print(f"threads: {torch.get_num_threads()}, load average before: {load_before[0]:.2f} (1 min), "
          f"{os.cpu_count()} CPUs")
    print(f"read bandwidth (torch sum of 1 GiB float32): median {bandwidth.median:.1f} GB/s "
          f"(min {bandwidth.low:.1f}, max {bandwidth.high:.1f}, {args.repeats} runs)\n")
    rows = []
    for decode in args.shapes.split(","):
        num_seqs, context = (int(x) for x in decode.lower().split("x"))
        native = None
        for token in args.formats.split(","):
            r = bench_format(token.strip(), shape, num_seqs, context, args.layers, args.repeats)
            k, t, kc = r["kernel"], r["torch"], r["kernel_cpu"]
            assert isinstance(k, Stat) and isinstance(t, Stat) and isinstance(kc, Stat)
            nbytes = int(r["nbytes"])  # type: ignore[call-overload]
            native = native or k.median
            rows.append([decode, r["format"], f"{k.median * 1e6:.0f} ({k.low * 1e6:.0f}-{k.high * 1e6:.0f})",
                         f"{kc.median * 1e6:.0f}",
                         f"{t.median * 1e6:.0f} ({t.low * 1e6:.0f}-{t.high * 1e6:.0f})",
                         f"{t.median / k.median:.1f}x", f"{native / k.median:.2f}x", f"{nbytes / 1e6:.2f}",
                         f"{nbytes / k.median / 1e9:.1f}", f"{nbytes / k.median / 1e9 / bandwidth.median:.0%}",
                         f"{r['diff']:.1e}"])
    first = args.formats.split(",")[0].strip()
    print(table(["shape", "format", "kernel us (min-max)", "kernel CPU us", "torch us (min-max)", "vs torch",
                 f"vs {first}",
                 "KV MB/call", "kernel GB/s", "of read bw", "max |diff|"], rows))
    load_after = os.getloadavg()
    print(f"\nload average after: {load_after[0]:.2f} (1 min); per call = one layer's attention, "
          f"median over {args.repeats} sweeps of {args.layers} layers; kernel CPU us = CPU time of all threads "
          "per call (about threads x wall when the cores are not shared)")


if __name__ == "__main__":
    main()
