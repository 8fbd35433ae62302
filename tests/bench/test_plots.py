"""Each benchmark's ``--plot`` drawing, on small made-up results: a PNG file is written."""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import pytest

from kvserve.bench import plots
from kvserve.bench.capacity import CapacityResult
from kvserve.bench.cli import add_bench_parser


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header (asserting it is one)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def chat_results() -> list[dict]:
    return [{"turn": i + 1, "prompt_tokens": 150 * (i + 1), "cached_tokens": 140 * i, "ttft_on_s": 0.3 + 0.01 * i,
             "ttft_off_s": 0.3 * (i + 1), "speedup": 0.3 * (i + 1) / (0.3 + 0.01 * i)} for i in range(5)]


def tier_results() -> list[dict]:
    out = []
    for config, scale in (("recompute only", 1.0), ("host", 0.25), ("disk", 0.3)):
        turns = [{"conversation": c, "turn": t, "prompt_tokens": 100 * t, "cached_tokens": 0,
                  "ttft_s": scale * (0.1 + 0.05 * t + 0.01 * c)} for t in range(4) for c in range(2)]
        out.append({"config": config, "turns": turns,
                    "ttft_mean_s": sum(t["ttft_s"] for t in turns) / len(turns)})
    return out


def capacity_results() -> list[CapacityResult]:
    return [CapacityResult(kv_format=f, backend="cpu", spec=f, bytes_per_token=b, num_blocks=n, max_num_seqs=s,
                           blocks_per_request=71, num_requests=s + 2, peak_concurrent=s, peak_running=s,
                           decode_batch=s, decode_steps=20, decode_tok_s=t, num_preemptions=1, wall_s=60.0)
            for f, b, n, s, t in (("native", 36864, 455, 6, 30.5), ("int8", 9792, 1713, 24, 70.1),
                                  ("kivi2", 2880, 5200, 73, 95.0))]


@pytest.mark.parametrize(("name", "draw", "ncols"), [
    ("chat", lambda p: plots.plot_chat(chat_results(), p), 2),
    ("tiers", lambda p: plots.plot_tiers(tier_results(), p), 2),
    ("capacity", lambda p: plots.plot_capacity(capacity_results(), p), 2),
    ("decode", lambda p: plots.plot_decode([{"batch": 1, "kvserve_tok_s": 17.6, "transformers_tok_s": 15.9},
                                            {"batch": 8, "kvserve_tok_s": 60.4, "transformers_tok_s": 63.7}], p), 1),
    ("serve", lambda p: plots.plot_serve([0.2, 1.5, 0.7, 4.0], [6.0, 7.5, 9.1, 10.8], p), 1),
    ("kv-decode", lambda p: plots.plot_step_parts(
        [{"kv_format": "native", "backend": "cpu", "tok_s": [97.7, 97.6], "products_ms": 3.5, "attention_ms": 30.1,
          "rest_ms": 5.5},
         {"kv_format": "int8", "backend": "cpu", "tok_s": [155.8], "products_ms": 3.5, "attention_ms": 13.2,
          "rest_ms": None}], p), 2),
    ("structured", lambda p: plots.plot_structured(
        [{"batch": 1, "baseline_sampling_ms": 0.29, "constrained_sampling_ms": 1.06},
         {"batch": 8, "baseline_sampling_ms": 0.15, "constrained_sampling_ms": 0.8}], p), 1),
])
def test_each_bench_draws_a_png(tmp_path, name, draw, ncols):
    path = tmp_path / f"{name}.png"
    assert draw(path) == path
    width, height = png_size(path)
    assert (width, height) == (int(6.0 * ncols * plots.DPI), int(4.2 * plots.DPI))
    assert path.stat().st_size > 10_000        # axes, lines and labels, not a blank canvas


def test_every_bench_takes_plot(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    for bench in ("chat", "decode", "serve", "capacity", "tiers", "structured"):
        args = parser.parse_args(["bench", bench, "--plot", str(tmp_path / "x.png")])
        assert args.plot == str(tmp_path / "x.png"), bench
