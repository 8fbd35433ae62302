"""``kvserve bench chat|decode``: benchmarks with their baselines in the same run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve.options import add_engine_args, engine_options


def run_chat(args: argparse.Namespace) -> int:
    from kvserve.bench import chat, plots
    from kvserve.bench.common import find_text, write_plot
    from kvserve.llm import LLM
    from kvserve.model.loader import load_model

    loaded = load_model(args.model)
    text = find_text(args.text)
    on = LLM(loaded=loaded, enable_prefix_caching=True, **engine_options(args))
    off = LLM(loaded=loaded, enable_prefix_caching=False, **engine_options(args))
    results, tbl = chat.run(on, off, text, args.target_tokens, args.words_per_turn, args.max_tokens,
                            args.repeats)
    later = [r["speedup"] for r in results if r["prompt_tokens"] >= args.target_tokens // 2]
    print(f"multi-turn chat, {loaded.source}, device {on.engine.device}, dtype {on.engine.dtype}, "
          f"median of {args.repeats} plays")
    print(tbl)
    if later:
        print(f"\nturns with >= {args.target_tokens // 2} prompt tokens: TTFT speedup "
              f"min {min(later):.1f}x, mean {sum(later) / len(later):.1f}x")
    write_plot(args.plot, lambda path: plots.plot_chat(results, path))
    _save(args, {"benchmark": "chat", "results": results})
    return 0


def run_decode(args: argparse.Namespace) -> int:
    from kvserve.bench import decode, plots
    from kvserve.bench.common import write_plot
    from kvserve.bench.random_model import random_model
    from kvserve.llm import LLM
    from kvserve.model.loader import load_model

    if args.random_model and args.model:
        raise ValueError("--random-model times a model of a shape: give it without --model")
    loaded = random_model(args.random_model) if args.random_model else load_model(args.model)
    llm = LLM(loaded=loaded, **engine_options(args))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows, tbl = decode.run(loaded, llm, sizes, args.new_tokens, args.repeats, args.hf_cache)
    graphs = ", CUDA graphs" if llm.engine.config.cuda_graphs else ""
    print(f"decode throughput, {loaded.source}, device {llm.engine.device}, dtype {llm.engine.dtype}{graphs}, "
          f"{args.new_tokens} new tokens per request, median of {args.repeats}; transformers' {args.hf_cache} cache")
    print(tbl)
    numbers = [{"batch": float(r[0]), "kvserve_tok_s": float(r[1]), "transformers_tok_s": float(r[2])}  # type: ignore[arg-type]
               for r in rows]
    write_plot(args.plot, lambda path: plots.plot_decode(numbers, path))
    _save(args, {"benchmark": "decode", "rows": rows})
    return 0


def _save(args: argparse.Namespace, payload: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks, each with its baseline in the same run")
    bsub = b.add_subparsers(dest="bench", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None)
    add_engine_args(common, ("device", "dtype"))
    common.add_argument("--json", default=None, help="also write the results to this JSON file")
    common.add_argument("--plot", default=None, metavar="FILE",
                        help="also draw the results as a PNG to this file (matplotlib, from the bench extra)")

    c = bsub.add_parser("chat", parents=[common], help="multi-turn chat TTFT, prefix cache on vs off")
    c.add_argument("--text", default=None, help="text for the user turns (default: the shipped botchan.txt)")
    c.add_argument("--target-tokens", type=int, default=2000, help="grow the history to this many tokens")
    c.add_argument("--words-per-turn", type=int, default=60)
    c.add_argument("--max-tokens", type=int, default=48, help="reply length per turn")
    c.add_argument("--repeats", type=int, default=3, help="plays of the conversation; TTFT is the median")
    c.set_defaults(run=run_chat)

    from kvserve.bench.random_model import SHAPES
    d = bsub.add_parser("decode", parents=[common], help="decode throughput vs transformers generate")
    d.add_argument("--batch-sizes", default="1,8,16")
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--random-model", choices=sorted(SHAPES), default=None,
                   help="a model of this shape with random weights (no file) instead of --model")
    d.add_argument("--hf-cache", choices=("dynamic", "static"), default="dynamic",
                   help="transformers' KV cache in generate: its default, or its static cache")
    add_engine_args(d, ("cuda_graphs",))
    d.set_defaults(run=run_decode)

    from kvserve.bench.serve import add_serve_bench_parser
    add_serve_bench_parser(bsub, common)
    from kvserve.bench.capacity import add_capacity_parser
    add_capacity_parser(bsub, common)
    from kvserve.bench.tiers import add_tiers_parser
    add_tiers_parser(bsub, common)
    from kvserve.bench.kv_decode import add_kv_decode_parser
    add_kv_decode_parser(bsub, common)
    from kvserve.bench.cluster import add_cluster_bench_parser
    add_cluster_bench_parser(bsub, common)
    from kvserve.bench.cluster_rag import add_cluster_rag_parser
    add_cluster_rag_parser(bsub, common)
    from kvserve.bench.structured import add_structured_parser
    add_structured_parser(bsub, common)
    from kvserve.bench.rag import add_rag_parser
    add_rag_parser(bsub, common)
    from kvserve.bench.peer import add_peer_parser
    add_peer_parser(bsub, common)
    from kvserve.bench.spec import add_spec_parser
    add_spec_parser(bsub, common)
