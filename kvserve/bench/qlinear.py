"""Micro-benchmark of the quantized-weight products (the C++ kernel, kvserve/model/csrc/qkernel.h)
per GGUF block type: how near the memory bandwidth each type's blocks are read, and how near
the box's integer peak their multiply-adds run.

    python -m kvserve.bench.qlinear [--types Q4_0,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K] [--rows 1,512]

Each type's blocks (random codes and sub-scales, small finite fp16 scales:
kvserve.model.formats.random_blocks) in Qwen2.5-0.5B's layer products: fused qkv (1152 x 896),
o (896 x 896), gate_up (9728 x 896) and down (896 x 4864), ``--layers`` layers, packed as the
loader packs them. The K-quants take K in whole super-blocks of 256, so their 896-column
products take 1024. Per batch of ``rows`` rows (decode batch, or prefill chunk): the time to
run every product once, the median of ``--repeats`` (min-max), and the weights' GB/s against
the read bandwidth measured in the same run (kv_decode.read_bandwidth), and the multiply-adds a
second (rows x N x K) against the integer peak measured in the same run: the kernel's own
4-product instruction (VNNI's vpdpbusd; AVX2's maddubs pair and adds) on registers alone, on
every thread (``int8_peak`` in qkernel.h). Decode rows are bound by the bytes, prefill chunks by
the arithmetic: the peak is the ceiling the latter are held to (the products also convert, scale
and add per half block of 16, which the peak leaves out). The types take turns within each
repeat, so a noisy neighbour slows each alike.

Where the CPU has AMX (Intel Xeon since Sapphire Rapids), batches of ``amx_rows`` rows and more
take its tiles (kvserve/model/csrc/amx.h); each batch is then timed both ways in the same
repeats, and the table adds the vector-only time, the tiles' speed-up, and the multiply-adds a
second against the tiles' own peak (their half-block instruction in 4 independent products on
every thread, ``amx_peak``), the ceiling those batches are held to.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from types import ModuleType

import torch

from kvserve.bench.common import table
from kvserve.bench.kv_decode import read_bandwidth
from kvserve.model.cpu_extension import load_extension
from kvserve.model.formats.cpu import CpuPackedProduct
from kvserve.model.formats.packing import GGUF_TYPES, SUPER, pack_gguf
from kvserve.model.formats.random_blocks import random_gguf_bytes

LAYER_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]   # (rows, cols): qkv, o, gate_up, down
DEFAULT_TYPES = "Q4_0,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K"
PEAK_ROUNDS = 5_000_000     # a thread's rounds of the integer-peak loop (8 instructions a round): ~0.1 s
AMX_PEAK_ROUNDS = 1_000_000  # the tiles' peak loop (4 instructions a round): ~0.03 s


def layer_products(ext: ModuleType, type_name: str, num_layers: int) -> list[CpuPackedProduct]:
    """``num_layers`` layers of products in ``type_name``'s blocks (K-quants: K rounded up to 256)."""
    block = GGUF_TYPES[type_name][1]
    products = []
    for layer in range(num_layers):
        for i, (rows, cols) in enumerate(LAYER_SHAPES):
            cols = -(-cols // SUPER) * SUPER if block == SUPER else cols
            raw = random_gguf_bytes(type_name, rows, cols, seed=layer * len(LAYER_SHAPES) + i)
            products.append(CpuPackedProduct(ext, pack_gguf(type_name, raw, rows, cols)))
    return products


def run_all(products: Sequence[CpuPackedProduct], xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for p in products:
        p(xs[p.cols])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default=DEFAULT_TYPES, help=f"GGUF types, comma-separated (default {DEFAULT_TYPES})")
    p.add_argument("--rows", default="1,512")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown:
        raise SystemExit(f"no kernel reads {', '.join(unknown)} (types: {', '.join(GGUF_TYPES)})")
    torch.set_num_threads(args.threads)
    ext = load_extension()
    if ext is None:
        raise SystemExit("the C++ quantized-weight kernel could not be built here (see the log)")
    weights = {t: layer_products(ext, t, args.layers) for t in types}
    g = torch.Generator().manual_seed(0)
    all_rows = [int(r) for r in args.rows.split(",")]
    inputs = {rows: {c: torch.randn(rows, c, generator=g) for c in {p.cols for ps in weights.values() for p in ps}}
              for rows in all_rows}
    bandwidth = read_bandwidth()
    peak = max(ext.int8_peak(PEAK_ROUNDS) for _ in range(3))
    amx_peak = max(ext.amx_peak(AMX_PEAK_ROUNDS) for _ in range(3)) if ext.amx() else 0.0
    # the tiles, then the vector unit alone (where AMX runs; else the one path there is, as set)
    paths = [True, False] if ext.amx() else [False]
    times: dict[tuple[str, int, bool], list[float]] = {(t, rows, amx): [] for t in types for rows in all_rows
                                                       for amx in paths}
    try:
        for rows in all_rows:
            for t in types:
                run_all(weights[t], inputs[rows])          # warm-up
            for _ in range(args.repeats):
                for t in types:
                    for amx in paths:
                        if len(paths) == 2:
                            ext.set_amx(amx)
                        times[(t, rows, amx)].append(run_all(weights[t], inputs[rows]))
    finally:
        if len(paths) == 2:
            ext.set_amx(True)                         # as it was: on
    bandwidth = max(bandwidth, read_bandwidth())      # again after the runs: the box may have quietened
    peak = max(peak, *(ext.int8_peak(PEAK_ROUNDS) for _ in range(3)))
    if amx_peak:
        amx_peak = max(amx_peak, *(ext.amx_peak(AMX_PEAK_ROUNDS) for _ in range(3)))
    out = []
    for rows in all_rows:
        for t in types:
            ts = times[(t, rows, paths[0])]
            nbytes = sum(p.nbytes for p in weights[t])
            macs = rows * sum(p.rows * p.cols for p in weights[t])
            m = statistics.median(ts)
            row = [t, rows, f"{nbytes / 2 ** 20:.0f}", f"{m * 1e3:.2f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})",
                   f"{nbytes / m / 1e9:.1f}", f"{nbytes / m / bandwidth:.0%}", f"{macs / m / 1e9:.0f}",
                   f"{macs / m / peak:.0%}"]
            if len(paths) == 2:
                alone = times[(t, rows, False)]
                ratios = sorted(a / b for a, b in zip(alone, ts, strict=True))
                tiles = rows >= ext.amx_rows
                row += [f"{statistics.median(alone) * 1e3:.2f}",
                        f"{statistics.median(alone) / m:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})" if tiles else "(vector)",
                        f"{macs / m / amx_peak:.0%}" if tiles else "-"]
            out.append(row)
    print(f"Qwen2.5-0.5B's layer products, {args.layers} layers, {ext.isa} kernel, {torch.get_num_threads()} "
          f"threads; median of {args.repeats} (min-max); read bandwidth {bandwidth / 1e9:.1f} GB/s; integer peak "
          f"{peak / 1e9:.0f} GMAC/s (the kernel's 4-product instruction on registers, every thread)")
    header = ["type", "rows", "MiB", "ms", "GB/s", "of bandwidth", "GMAC/s", "of int8 peak"]
    if len(paths) == 2:
        print(f"AMX: batches of {ext.amx_rows} rows or more take the tiles; 'vector ms' is the same batch with "
              "them switched off, 'AMX' the speed-up (median, min-max of the repeats' ratios); AMX peak "
              f"{amx_peak / 1e9:.0f} GMAC/s (the tiles' half-block instruction, every thread)")
        header += ["vector ms", "AMX", "of AMX peak"]
    print(table(header, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
