"""Micro-benchmark of the dense-product backends (kvserve/model/linear.py).

    python -m kvserve.bench.linear [--rows 1,4,16,64,512] [--repeats 7]

SmolLM2-135M's products: 30 layers of fused qkv (960 x 576), o (576 x 576), gate_up
(3072 x 576) and down (576 x 1536), 425 MB of float32 weights, then the LM head
(49,152 x 576, 113 MB). Per batch of ``rows`` rows (decode batch size, or prefill chunk
length): the time to run every product once with ``F.linear`` (and the LM head as the
engine runs it on the torch backend, ``W @ h^T``) and with oneDNN's packed product, in the
same run on the same inputs; the weights' GB/s against the machine's read bandwidth
measured in the same run (kv_decode.read_bandwidth). Medians of ``--repeats``, with spread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from kvserve.bench.common import table
from kvserve.bench.kv_decode import read_bandwidth
from kvserve.model.linear import OneDnnLinear, onednn_unavailable_reason

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)


def _torch_layers(layers: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        for w in layer:
            F.linear(xs[w.shape[1]], w)


def _onednn_layers(onednn: OneDnnLinear, layers: list[list[torch.Tensor]], packed: list[list[torch.Tensor]],
                   xs: dict[int, torch.Tensor]) -> None:
    for layer, pl in zip(layers, packed):
        for w, pw in zip(layer, pl):
            onednn(xs[w.shape[1]], pw)


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16,64,512")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    reason = onednn_unavailable_reason(torch.device("cpu"), torch.float32)
    if reason is not None:
        raise SystemExit(f"oneDNN cannot run here: {reason}")
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(o, i, generator=g) * i ** -0.5 for o, i in LAYER_SHAPES] for _ in range(args.layers)]
    head = torch.randn(*LM_HEAD, generator=g) * LM_HEAD[1] ** -0.5
    onednn = OneDnnLinear()
    packed = [[onednn.prepare(w) for w in layer] for layer in layers]
    packed_head = onednn.prepare(head)
    layer_bytes = sum(w.numel() * 4 for layer in layers for w in layer)
    head_bytes = head.numel() * 4
    bandwidth = read_bandwidth()
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i, generator=g) for _, i in LAYER_SHAPES}
        h = torch.randn(rows, LM_HEAD[1], generator=g)

        cases: list[tuple[str, int, Callable[[], object], Callable[[], object]]] = [
            ("layers", layer_bytes, partial(_torch_layers, layers, xs), partial(_onednn_layers, onednn, layers, packed, xs)),
            ("LM head", head_bytes, partial(torch.mm, head, h.t()), partial(onednn, h, packed_head))]
        for name, nbytes, ref, new in cases:
            a, b = _times(ref, args.repeats), _times(new, args.repeats)
            ma, mb = statistics.median(a), statistics.median(b)
            rows_out.append([name, rows, f"{ma * 1e3:.2f} ({min(a) * 1e3:.2f}-{max(a) * 1e3:.2f})",
                             f"{mb * 1e3:.2f} ({min(b) * 1e3:.2f}-{max(b) * 1e3:.2f})", f"{ma / mb:.2f}x",
                             f"{nbytes / ma / 1e9:.1f}", f"{nbytes / mb / 1e9:.1f}"])
    print(f"SmolLM2-135M's products, {args.layers} layers ({layer_bytes / 1e6:.0f} MB) and the LM head "
          f"({head_bytes / 1e6:.0f} MB), float32, {torch.get_num_threads()} threads; median of {args.repeats} "
          f"(min-max); read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(table(["products", "rows", "F.linear ms", "onednn ms", "speedup", "F.linear GB/s", "onednn GB/s"],
                rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
