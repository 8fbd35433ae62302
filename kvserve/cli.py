"""Command line: ``kvserve generate``, ``kvserve chat``, ``kvserve bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from kvserve.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face model directory, or the default SmolLM2-135M-Instruct")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="compute dtype (auto: float32 on CPU, the model's dtype on CUDA)")
    g.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache memory in GiB (default 1)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides --kv-cache-gb)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    g.add_argument("--kv-format", default=None,
                   help="KV storage: native (default), fp16, bf16, fp8, int8, int4, kivi2, kivi4, with +outN/+had "
                        "and per-layer or per-half specs, e.g. '0-1=fp16;2-=kivi2' (docs/kv_formats.md)")
    g.add_argument("--kv-budget", type=int, default=None,
                   help="tokens of KV cache kept per layer for each request (default: no budget; docs/budgets.md)")
    g.add_argument("--kv-policy", default=None,
                   help="what a budgeted request keeps: streaming (default), h2o, snapkv, pyramid, merge, arkvale, "
                        "arkvale-bound, arkvale-w<0..1>")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 512)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once (default 64)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority", "lpm"], default=None,
                   help="admission order (default lpm: longest cached prefix first, no starvation)")
    g.add_argument("--engine-seed", type=int, default=None, help="seed of unseeded sampling")
    t = p.add_argument_group("offload tiers (docs/offload.md): evicted KV blocks go to every tier given; "
                             "prefix hits are looked up in host, then disk, then Redis")
    t.add_argument("--host-cache-gb", type=float, default=None, help="host-memory tier size in GiB (default: off)")
    t.add_argument("--disk-cache", default=None, metavar="DIR",
                   help="disk tier directory; persists across restarts, one engine per directory (default: off)")
    t.add_argument("--disk-cache-gb", type=float, default=None, help="disk tier size in GiB (default 16)")
    t.add_argument("--redis-url", default=None,
                   help="Redis tier shared by engines, e.g. redis://host:6379/0 (default: off)")
    t.add_argument("--redis-ttl-s", type=float, default=None, help="expire Redis blocks after this many seconds")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "kv_cache_memory_gb": args.kv_cache_gb, "num_kv_blocks": args.num_kv_blocks,
        "block_size": args.block_size, "kv_format": args.kv_format,
        "kv_budget": args.kv_budget, "kv_policy": args.kv_policy,
        "enable_prefix_caching": not args.no_prefix_caching,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
        "enable_chunked_prefill": not args.no_chunked_prefill, "scheduling_policy": args.scheduling_policy,
        "seed": args.engine_seed,
        "host_cache_gb": args.host_cache_gb, "disk_cache_dir": args.disk_cache, "disk_cache_gb": args.disk_cache_gb,
        "redis_url": args.redis_url, "redis_ttl_s": args.redis_ttl_s,
    }


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def make_llm(args: argparse.Namespace):
    from kvserve.llm import LLM
    return LLM(args.model, **engine_options(args))


def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    prompts = args.prompt
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        results = llm.generate(prompts, params)
    for r in results:
        print(r.text, file=out)
        print(f"[{len(r.token_ids)} tokens, finish: {r.finish_reason}, time to first token "
              f"{r.ttft * 1000:.0f} ms, {r.num_cached_tokens}/{r.num_prompt_tokens} prompt tokens from cache]",
              file=out)
    return 0


def cmd_chat(args: argparse.Namespace, inp: TextIO, out: TextIO) -> int:
    llm = make_llm(args)
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = inp.isatty()
    if interactive:
        print("kvserve chat: type a message; /reset clears the history, /exit quits.", file=out)
    while True:
        if interactive:
            print("you> ", end="", file=out, flush=True)
        line = inp.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)", file=out)
            continue
        history.append({"role": "user", "content": text})
        r = llm.chat(history, params)[0]
        history.append({"role": "assistant", "content": r.text})
        print(f"assistant> {r.text}", file=out)
        print(f"[time to first token {r.ttft * 1000:.0f} ms, {r.num_cached_tokens}/{r.num_prompt_tokens} "
              f"prompt tokens from cache, {len(r.token_ids)} tokens generated]", file=out, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user turn")
    add_engine_args(g)
    add_sampling_args(g, max_tokens=64)

    c = sub.add_parser("chat", help="interactive chat; prints time to first token and cache hits per turn")
    c.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=256)

    from kvserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    from kvserve.server.cli import add_serve_parser
    add_serve_parser(sub)
    from kvserve.plan.cli import add_plan_parser
    add_plan_parser(sub)
    from kvserve.eval.cli import add_eval_budget_parser, add_eval_parser
    add_eval_parser(sub)
    add_eval_budget_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args, sys.stdout)
        if args.command == "chat":
            return cmd_chat(args, sys.stdin, sys.stdout)
        return args.run(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
