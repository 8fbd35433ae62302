"""Each benchmark's ``--plot`` drawing, on small made-up results: a PNG file is written."""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import pytest

from kvserve.bench import plots
from kvserve.bench.capacity import CapacityResult
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.cluster import Run
from kvserve.bench.cluster_rag import RagRun
from kvserve.bench.rag import Answer, RagResult


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


def rag_results() -> list[RagResult]:
    def answers(ttfts: list[float], correct: int) -> tuple[Answer, ...]:
        return tuple(Answer(t, (1, 2), "42", i < correct, 2000, 0, 1800, 180, 0) for i, t in enumerate(ttfts))

    return [RagResult("full", None, answers([1.2, 1.4, 1.3], 3), (1.0, 1.0, 1.0), 3),
            RagResult("blend@0.1", 0.1, answers([0.3, 0.25, 0.4], 2), (1.0, 0.5, 0.0), 1)]


def peer_rows() -> list[dict]:
    return [{"label": "decode, batch 1", "kvserve_tok_s": 250.5, "llama_tok_s": 132.3, "ratio": 1.89},
            {"label": "prefill 512", "kvserve_tok_s": 1878.0, "llama_tok_s": None, "ratio": None}]


def cluster_runs() -> list[dict]:
    return [Run(name, ttft_s=ttft, prompt_tokens=1000, cached_tokens=cached, routed_to_holder=holder).summary()
            for name, ttft, cached, holder in (("single", [0.08, 0.1, 0.5], 858, None),
                                               ("kv", [0.2, 0.25, 0.9], 858, 1.0),
                                               ("pow2", [0.3, 0.35, 1.3], 732, 0.5))]


def cluster_rag_runs() -> list[dict]:
    return [RagRun(name, ttft_s=ttft, stored_tokens=stored, reused_tokens=reused).summary()
            for name, ttft, stored, reused in (("single", [0.2, 0.3], 5760.0, 20000.0), ("kv", [0.3, 0.4], 6100.0, 19000.0),
                                               ("pow2", [0.6, 0.9], 11000.0, 17000.0))]


# bench name -> (the results its --plot is drawn from, up to the path; the figure's columns)
def spec_rows() -> list[dict]:
    return [{"workload": w, "batch": b, "plain_tok_s": 200.0 / b, "spec_tok_s": 400.0 / b, "bound_tok_s": 500.0 / b,
             "acceptance": 0.6} for w in ("grounded", "open") for b in (1, 4)]


SAMPLES: dict[str, tuple[tuple, int]] = {
    "chat": ((chat_results(),), 2),
    "tiers": ((tier_results(),), 2),
    "capacity": ((capacity_results(),), 2),
    "decode": (([{"batch": 1, "kvserve_tok_s": 17.6, "transformers_tok_s": 15.9},
                 {"batch": 8, "kvserve_tok_s": 60.4, "transformers_tok_s": 63.7}],), 1),
    "serve": (([0.2, 1.5, 0.7, 4.0], [6.0, 7.5, 9.1, 10.8]), 1),
    "kv-decode": (([{"kv_format": "native", "backend": "cpu", "tok_s": [97.7, 97.6], "products_ms": 3.5,
                     "attention_ms": 30.1, "rest_ms": 5.5},
                    {"kv_format": "int8", "backend": "cpu", "tok_s": [155.8], "products_ms": 3.5,
                     "attention_ms": 13.2, "rest_ms": None}],), 2),
    "structured": (([{"batch": 1, "baseline_sampling_ms": 0.29, "constrained_sampling_ms": 1.06},
                     {"batch": 8, "baseline_sampling_ms": 0.15, "constrained_sampling_ms": 0.8}],), 1),
    "rag": ((rag_results(),), 1),
    "peer": ((peer_rows(),), 2),
    "spec": ((spec_rows(),), 2),
    "cluster": ((cluster_runs(),), 2),
    "cluster-rag": ((cluster_rag_runs(),), 2),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_bench_draws_a_png(tmp_path, name):
    results, ncols = SAMPLES[name]
    path = tmp_path / f"{name}.png"
    assert plots.PLOTS[name](*results, path) == path
    width, height = png_size(path)
    assert (width, height) == (int(6.0 * ncols * plots.DPI), int(4.2 * plots.DPI))
    assert path.stat().st_size > 10_000        # axes, lines and labels, not a blank canvas


def bench_subparsers() -> dict[str, argparse.ArgumentParser]:
    """``kvserve bench``'s subcommands, from the parser itself."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))

    def choices(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        (action,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(action.choices)

    return choices(choices(parser)["bench"])


def test_every_bench_that_offers_plot_draws_it():
    """A bench offers --plot exactly when ``plots.PLOTS`` names what it draws, and each of
    those draws a sample above: a new bench with an ignored --plot fails here."""
    offering = {name for name, p in bench_subparsers().items() if "--plot" in p._option_string_actions}
    assert offering == set(plots.PLOTS)
    assert set(SAMPLES) == set(plots.PLOTS)


def test_every_bench_takes_json_and_plot(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    for bench in plots.PLOTS:
        args = parser.parse_args(["bench", bench, "--json", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")])
        assert (args.json, args.plot) == (str(tmp_path / "x.json"), str(tmp_path / "x.png")), bench
