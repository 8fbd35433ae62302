"""``kvserve bench tiers``: conversations whose histories outgrow the device pool, served
with offload tiers vs recomputed.

``num_conversations`` chats share one system prompt; their turns are interleaved
(turn 1 of every chat, then turn 2 of every chat, ...), so by the time a chat comes
back its history has been evicted from the small device pool by the others. Every
configuration replays exactly the same messages (the replies of the first run), so
all of them prefill the same prompts; each turn is one request, alone, and its time to
first token is the engine's (arrival to first token).

Reported per configuration: TTFT mean / p50 / p95, total time, where the prompt tokens
came from (device, each tier, computed), and the cost model's figures: measured
prefill speed, each tier's latency and bandwidth, and the break-even run length (the
fewest blocks for which loading beats recomputing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.chat import passages
from kvserve.bench.common import table
from kvserve.engine.stats import EngineStats
from kvserve.kv.block_io import block_nbytes
from kvserve.llm import LLM
from kvserve.offload.cost import CostSnapshot, TierCost
from kvserve.offload.measure import throwaway_redis
from kvserve.offload.registry import TIERS
from kvserve.options import CommandDefault, add_engine_args
from kvserve.sampling_params import SamplingParams

SYSTEM = ("You are a careful reader in a long reading group. Members share passages of a novel, one at a "
          "time; answer each question about the passage briefly, and keep track of the story so far.")


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    reply: str


@dataclass(frozen=True)
class Play:
    name: str
    turns: list[Turn]
    total_s: float
    stats: EngineStats
    block_nbytes: int
    block_size: int


def user_turns(text: str, num_conversations: int, num_turns: int, words: int) -> list[list[str]]:
    """Distinct passages for every (conversation, turn)."""
    chunks = passages(text, words)
    need = num_conversations * num_turns
    if len(chunks) < need:
        raise ValueError(f"the text has {len(chunks)} passages of {words} words; {need} are needed")
    return [[f"Passage {c + 1}.{t + 1}:\n{chunks[c * num_turns + t]}\nWhat happens here, and who speaks?"
             for t in range(num_turns)] for c in range(num_conversations)]


def play(name: str, llm: LLM, turns: list[list[str]], max_tokens: int,
         replies: dict[tuple[int, int], str] | None = None) -> Play:
    """Interleave the conversations turn by turn; with ``replies`` the histories hold them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    llm.generate("Warm-up.", SamplingParams(max_tokens=2, temperature=0.0))   # first-call costs, not measured
    histories = [[{"role": "system", "content": SYSTEM}] for _ in turns]
    log: list[Turn] = []
    start = time.perf_counter()
    for t in range(len(turns[0])):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": turns[c][t]})
            out = llm.chat(history, params)[0]
            reply = replies[(c, t)] if replies is not None else out.text
            history.append({"role": "assistant", "content": reply})
            log.append(Turn(c, t, out.num_prompt_tokens, out.num_cached_tokens, out.ttft or 0.0, reply))
    total = time.perf_counter() - start
    engine = llm.engine
    return Play(name, log, total, engine.stats(), block_nbytes(engine.runner.cache.block_tensors()), engine.config.cache.block_size)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def break_even_blocks(tier: TierCost, cost: CostSnapshot, block_size: int, block_nbytes: int) -> float | None:
    """Fewest blocks for which loading from ``tier`` beats recomputing (inf: never; None: unmeasured)."""
    if cost.prefill_tokens_per_s is None:
        return None
    saved_per_block = block_size / cost.prefill_tokens_per_s - block_nbytes / tier.bytes_per_s
    if saved_per_block <= 0:
        return math.inf
    return max(1.0, tier.latency_s / saved_per_block)


def summary(p: Play, baseline: Play | None) -> dict[str, Any]:
    ttfts = [t.ttft_s for t in p.turns]
    s = p.stats
    query = max(1, s.prefix_query_tokens)
    out: dict[str, Any] = {
        "config": p.name, "requests": len(p.turns), "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 0.95), "total_s": p.total_s,
        "prompt_tokens": s.prefix_query_tokens, "device_hit_rate": s.prefix_hit_tokens / query,
        "tier_hit_rates": {t.tier: t.hit_tokens / query for t in s.tiers},
        "computed_rate": 1 - (s.prefix_hit_tokens + s.tier_hit_tokens) / query,
    }
    if baseline is not None:
        out["ttft_mean_speedup"] = statistics.fmean(t.ttft_s for t in baseline.turns) / out["ttft_mean_s"]
    if s.cost is not None:
        c = s.cost
        out["prefill_tokens_per_s"] = c.prefill_tokens_per_s
        out["runs_loaded"], out["runs_cut"], out["runs_probed"] = c.runs_loaded, c.runs_cut, c.runs_probed
        out["tiers"] = [{"tier": t.tier, "measured": t.is_measured, "latency_ms": t.latency_s * 1e3,
                         "read_mb_per_s": t.bytes_per_s / 1e6,
                         "break_even_blocks": break_even_blocks(t, c, p.block_size, p.block_nbytes)}
                        for t in c.tiers]
    return out


def tables(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        tiers = ", ".join(f"{k} {v:.0%}" for k, v in r["tier_hit_rates"].items()) or "-"
        speedup = f"{r['ttft_mean_speedup']:.1f}x" if "ttft_mean_speedup" in r else "-"
        rows.append([r["config"], r["requests"], f"{r['ttft_mean_s'] * 1e3:.0f}", f"{r['ttft_p50_s'] * 1e3:.0f}",
                     f"{r['ttft_p95_s'] * 1e3:.0f}", speedup, f"{r['total_s']:.1f}", f"{r['device_hit_rate']:.0%}",
                     tiers, f"{r['computed_rate']:.0%}"])
    main = table(["config", "requests", "TTFT mean ms", "p50 ms", "p95 ms", "mean speedup", "total s",
                  "device hits", "tier hits", "computed"], rows)
    cost_rows = []
    for r in results:
        for t in r.get("tiers", []):
            be = t["break_even_blocks"]
            be_text = "-" if be is None else "never" if math.isinf(be) else f"{be:.1f}"
            cost_rows.append([r["config"], t["tier"], "yes" if t["measured"] else "prior",
                              f"{t['latency_ms']:.2f}", f"{t['read_mb_per_s']:.0f}",
                              f"{r['prefill_tokens_per_s']:.0f}" if r.get("prefill_tokens_per_s") else "-",
                              be_text, f"{r['runs_loaded']}/{r['runs_cut']}/{r['runs_probed']}"])
    if not cost_rows:
        return main
    return main + "\n\n" + table(["config", "tier", "measured", "latency ms", "read MB/s", "prefill tok/s",
                                  "break-even blocks", "runs loaded/cut/probed"], cost_rows)


def engine_options(args: argparse.Namespace, scratch: str, redis_url: str | None) -> dict[str, dict[str, Any]]:
    """The LLM options that turn on each tier ``--tiers`` names (the registry's words), alone."""
    return {"host": {"host_cache_gb": args.host_cache_gb},
            "disk": {"disk_cache_dir": args.disk_cache_dir or f"{scratch}/blocks"},
            "redis": {"redis_url": redis_url}}


def run_bench(args: argparse.Namespace) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import find_text, write_plot
    from kvserve.model.loader import load_model

    if args.tiers is None:
        tiers = ["host", "disk"] + (["redis"] if args.redis_url or shutil.which("redis-server") else [])
    else:
        tiers = [t for t in args.tiers.split(",") if t]
    unknown = [t for t in tiers if t not in TIERS]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r} in --tiers; use {', '.join(TIERS)}")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    turns = user_turns(find_text(args.text), args.conversations, args.turns, args.words_per_turn)
    loaded = load_model(args.model)
    base = {"device": args.device, "dtype": args.dtype, "kv_cache_memory_gb": args.kv_cache_memory_gb,
            "kv_format": args.kv_format}
    configs: list[tuple[str, dict[str, Any]]] = [("recompute only", {})]
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-bench-disk-"))
        redis_url = args.redis_url
        if "redis" in tiers and not redis_url:
            redis_url = stack.enter_context(throwaway_redis())
            if redis_url is None:
                raise ValueError("--tiers redis needs --redis-url, or redis-server on PATH to start one")
        by_tier = engine_options(args, scratch, redis_url)
        configs += [(tier, by_tier[tier]) for tier in tiers]
        plays: list[Play] = []
        replies: dict[tuple[int, int], str] | None = None
        for name, options in configs:
            with LLM(loaded=loaded, **base, **options) as llm:
                if not plays:
                    print(f"{args.conversations} conversations x {args.turns} turns, {loaded.source}, device "
                          f"{llm.engine.device}, dtype {llm.engine.dtype}, KV format {llm.engine.kv_format.spec}, "
                          f"{llm.engine.kv.num_blocks} device blocks of {llm.engine.config.cache.block_size} "
                          f"tokens ({block_nbytes(llm.engine.runner.cache.block_tensors())} bytes each)", flush=True)
                p = play(name, llm, turns, args.max_tokens, replies)
            if replies is None:
                replies = {(t.conversation, t.turn): t.reply for t in p.turns}
            print(f"  {name}: {p.total_s:.1f} s", flush=True)
            plays.append(p)
    for p in plays[1:]:
        if [t.prompt_tokens for t in p.turns] != [t.prompt_tokens for t in plays[0].turns]:
            raise RuntimeError(f"{p.name}: the runs prefilled different prompts")
    results = [summary(p, plays[0] if i else None) for i, p in enumerate(plays)]
    for r, p in zip(results, plays):
        r["turns"] = [{"conversation": t.conversation, "turn": t.turn, "prompt_tokens": t.prompt_tokens,
                       "cached_tokens": t.cached_tokens, "ttft_s": t.ttft_s} for t in p.turns]
    longest = max(t.prompt_tokens for t in plays[0].turns)
    print(f"prompts up to {longest} tokens; the device pool holds {plays[0].stats.kv_num_blocks} blocks")
    print(tables(results))
    write_plot(args.plot, lambda path: plots.plot_tiers(results, path))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "tiers", "results": results}, indent=2))
    return 0


def add_tiers_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    t = bsub.add_parser("tiers", parents=[common],
                        help="multi-conversation TTFT with offload tiers vs recompute only (small device pool)")
    t.add_argument("--conversations", type=int, default=4)
    t.add_argument("--turns", type=int, default=12, help="turns per conversation (interleaved)")
    t.add_argument("--words-per-turn", type=int, default=20)
    t.add_argument("--max-tokens", type=int, default=32, help="reply length per turn")
    t.add_argument("--tiers", default=None,
                   help="tier configurations to run, each alone: host,disk,redis (default: all three; redis "
                        "only when --redis-url is given or redis-server is installed)")
    t.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 when other jobs share the cores)")
    t.add_argument("--text", default=None, help="text for the user turns (default: the shipped botchan.txt)")
    # each tier's flag sizes or places that tier in its own run; the recompute-only run has none
    add_engine_args(t, ("kv_cache_memory_gb", "kv_format", "host_cache_gb", "disk_cache_dir", "redis_url"), defaults={
        "kv_cache_memory_gb": CommandDefault(0.05, "small, so that the histories outgrow it"),
        "host_cache_gb": CommandDefault(4.0, "in the host tier's run"),
        "disk_cache_dir": CommandDefault(None, "a temporary one, in the disk tier's run"),
        "redis_url": CommandDefault(None, "a throwaway redis-server on a free loopback port, in the redis tier's run")})
    t.set_defaults(run=run_bench)
