"""``kvserve bench cluster``: multi-turn chats on engine replicas, KV-aware routing vs Ray
Serve's default, with and without write-through, against one engine (docs/cluster.md).

``num_conversations`` chats share one system prompt; each sends its turns one after
another, and at most ``concurrency`` turns are in flight (a FIFO semaphore): with 1 (the
default) the turns interleave round-robin (turn 1 of every chat, then turn 2, ...), one
request at a time, so a turn's time to first token is its own prefill, not a queue
behind other chats; with ``--concurrency`` as high as the chats, they all run at once. Each chat is about its
own document (the first user turn, ``doc_words`` words), then short questions: the
history is long and each turn adds little, as in chats over a document or a code base. Each replica's device
pool (``--num-kv-blocks``) holds about its share of the conversations, not all of them;
the single engine gets the replicas' pools together (the same KV memory). So the fleet's
cache holds everything only when each conversation stays on one replica. Each configuration is a
fresh ``kvserve serve`` (a local Ray cluster for the replicated ones) and a flushed Redis;
every one replays the same messages (the replies of the first, single-engine run), so all
prefill the same prompts. Per configuration: time to first token as the client sees it
(streaming), the prompt tokens served from a cache (device or Redis, ``cached_tokens``),
and from the ingress's /metrics the share routed to the replica holding the prefix.

Goals (issue 13): fleet prefix-hit rate >= 95% of one engine's; mean TTFT with KV-aware
routing >= 2x lower than with Serve's default routing without write-through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.chat import passages
from kvserve.bench.common import table
from kvserve.bench.serve import free_port, percentile, start_server
from kvserve.bench.tiers import SYSTEM
from kvserve.options import CommandDefault, add_engine_args

CONFIGS = {   # name -> kvserve serve flags (the replicated ones get --replicas and the CPU split too)
    "single": [],
    "kv": ["--routing", "kv"],
    "kv+wt": ["--routing", "kv", "--write-through"],
    "pow2": ["--routing", "pow2"],
    "pow2+wt": ["--routing", "pow2", "--write-through"],
}


@dataclass
class Run:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    routed_to_holder: float | None = None
    tier_hit_tokens: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate, "ttft_mean_s": statistics.fmean(self.ttft_s or [0.0]),
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p95_s": percentile(self.ttft_s, 0.95)}


def user_turns(text: str, num_conversations: int, num_turns: int, doc_words: int, words: int) -> list[list[str]]:
    """Per conversation: a document of its own, then ``num_turns - 1`` short questions."""
    docs = passages(text, doc_words)[1:]     # the first passage is the system prompt's notes
    all_words = text.split()
    questions = passages(" ".join(all_words[len(all_words) // 3:]), words)    # from later in the book
    if len(docs) < num_conversations or len(questions) < num_conversations * num_turns:
        raise ValueError("the text is too short for this many conversations and turns")
    return [[f"Here is a document to discuss:\n{docs[c]}\nWhat is it about?",
             *(f"Question {t}: what about '{questions[c * num_turns + t]}'?" for t in range(1, num_turns))]
            for c in range(num_conversations)]


def system_prompt(text: str, words: int) -> str:
    notes = " ".join(text.split()[:words])
    return f"{SYSTEM}\nThe group's notes so far:\n{notes}"


async def _turn(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, dict]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return await streamed(client, "/v1/chat/completions", body)


async def streamed(client: Any, path: str, body: dict[str, Any]) -> tuple[float, str, dict]:
    """POST ``body`` to ``path`` (chat or completions) streaming, with usage: the time to the
    first text, the text and the usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, pieces, usage = None, [], None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(text)
    if usage is None:
        raise RuntimeError("no usage")
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(pieces), usage


async def play(url: str, run: Run, model: str, system: str, turns: list[list[str]], max_tokens: int,
               replies: dict[tuple[int, int], str], concurrency: int) -> None:
    """Each conversation's turns in order, at most ``concurrency`` turns of all at once."""
    import httpx

    slots = asyncio.Semaphore(concurrency)    # FIFO: with 1 the conversations take turns round-robin

    async def conversation(client: httpx.AsyncClient, c: int) -> None:
        history = [{"role": "system", "content": system}]
        for t, user in enumerate(turns[c]):
            history.append({"role": "user", "content": user})
            try:
                async with slots:
                    ttft, text, usage = await _turn(client, model, history, max_tokens)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails
                run.errors.append(f"conversation {c} turn {t}: {e}")
                return
            run.ttft_s.append(ttft)
            run.prompt_tokens += usage["prompt_tokens"]
            run.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            history.append({"role": "assistant", "content": replies.setdefault((c, t), text)})

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _turn(client, model, [{"role": "user", "content": "Warm-up."}], 2)   # first-call costs
        await asyncio.gather(*(conversation(client, c) for c in range(len(turns))))
    run.wall_s = time.perf_counter() - start


def scrape(url: str, run: Run) -> None:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("kvserve_cluster_routed_to_holder_ratio "):
            run.routed_to_holder = float(line.split()[-1])
        elif line.startswith(("kvserve_cluster_replica_prefix_hit_tokens_total{",
                              "kvserve_prefix_cache_hit_tokens_total{")) and "tier=" in line:
            tier = line.split('tier="')[1].split('"')[0]
            run.tier_hit_tokens[tier] = run.tier_hit_tokens.get(tier, 0.0) + float(line.split()[-1])


def run_config(name: str, args: argparse.Namespace, redis_url: str, system: str, turns: list[list[str]],
               replies: dict[tuple[int, int], str]) -> Run:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushall()     # every configuration starts with an empty shared tier
    client.close()
    run = Run(name, load_before=os.getloadavg()[0])
    with serving(server_flags(args, name == "single", ["--redis-url", redis_url, *CONFIGS[name]])) as url:
        asyncio.run(play(url, run, args.served_model_name, system, turns, args.max_tokens, replies,
                         args.concurrency))
        time.sleep(2.5)      # the replicas' stats reach the ingress's /metrics within a poll
        scrape(url, run)
    run.load_after = os.getloadavg()[0]
    return run


def server_flags(args: argparse.Namespace, single: bool, flags: list[str]) -> list[str]:
    """``kvserve serve`` flags for a configuration: the model, ``flags``, the user's
    ``--server-arg``s, and either one engine with the replicas' KV memory together
    (``single``) or the replicas, each with its pool and CPU share. A pool smaller than the model's
    window starts with the window lowered to fit (the chats here are far shorter)."""
    out = [*(["--model", args.model] if args.model else []), "--device", args.device, "--dtype", args.dtype,
           "--max-model-len-fit", "lower", *flags, *args.server_arg]
    if single:
        return [*out, "--num-kv-blocks", str(args.num_kv_blocks * args.replicas)]
    return [*out, "--num-kv-blocks", str(args.num_kv_blocks), "--replicas", str(args.replicas),
            "--replica-cpus", str(args.replica_cpus), "--ray-num-cpus", str(args.ray_num_cpus)]


@contextmanager
def serving(extra: list[str]) -> Iterator[str]:
    """A ``kvserve serve`` with ``extra`` flags on a free loopback port; yields its URL."""
    port = free_port()
    proc = start_server(port, extra, timeout_s=300)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except Exception:  # noqa: BLE001 - it would not stop: kill it
            proc.kill()
            proc.wait()


def report(runs: list[Run]) -> str:
    ms = lambda s: f"{s * 1000:,.0f}"
    rows = []
    for r in runs:
        split = ", ".join(f"{t} {v:,.0f}" for t, v in sorted(r.tier_hit_tokens.items()))
        rows.append([r.name, ms(statistics.fmean(r.ttft_s or [0.0])), ms(percentile(r.ttft_s, 0.5)),
                     ms(percentile(r.ttft_s, 0.95)), f"{r.hit_rate:.1%}", split or "-",
                     "-" if r.routed_to_holder is None or "pow2" in r.name else f"{r.routed_to_holder:.0%}",
                     f"{r.wall_s:.1f}",
                     f"{r.load_before:.1f} / {r.load_after:.1f}"])
    lines = [table(["config", "TTFT mean ms", "p50", "p95", "prefix hits", "hit tokens by tier",
                    "to holder", "wall s", "load before/after"], rows)]
    by = {r.name: r for r in runs}
    mean = lambda n: statistics.fmean(by[n].ttft_s) if n in by and by[n].ttft_s else float("nan")
    if "single" in by:
        for n in ("kv", "kv+wt"):
            if n in by:
                ratio = by[n].hit_rate / max(by["single"].hit_rate, 1e-9)
                lines.append(f"goal: {n} fleet hit rate / single engine's = {ratio:.1%} (>= 95%: "
                             f"{'met' if ratio >= 0.95 else 'missed'})")
    if "pow2" in by:
        for n in ("kv", "kv+wt"):
            if n in by:
                ratio = mean("pow2") / mean(n)
                lines.append(f"goal: mean TTFT pow2 / {n} = {ratio:.2f}x (>= 2x: {'met' if ratio >= 2 else 'missed'})")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import find_text, write_plot
    from kvserve.offload.measure import throwaway_redis

    text = find_text(args.text)
    turns = user_turns(text, args.conversations, args.turns, args.doc_words, args.words_per_turn)
    system = system_prompt(text, args.system_words)
    replies: dict[tuple[int, int], str] = {}
    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    runs = []
    with throwaway_redis() as local_url:
        redis_url = args.redis_url or local_url
        if redis_url is None:
            raise ValueError("no redis-server installed and no --redis-url given")
        for name in names:
            run = run_config(name, args, redis_url, system, turns, replies)
            print(f"{name}: {len(run.ttft_s)} turns, mean TTFT {statistics.fmean(run.ttft_s or [0]) * 1000:,.0f} ms, "
                  f"hits {run.hit_rate:.1%}, {len(run.errors)} errors, {run.wall_s:.1f} s", flush=True)
            runs.append(run)
    print(f"kvserve bench cluster: {args.conversations} conversations x {args.turns} turns, {args.concurrency} at "
          f"once, {args.doc_words}-word document each, shared system "
          f"prompt, {args.max_tokens} tokens per reply, {runs[0].prompt_tokens:,} prompt tokens; {args.replicas} "
          f"replicas of {args.num_kv_blocks} KV blocks at {args.replica_cpus} CPU each on a {args.ray_num_cpus}-CPU "
          f"Ray (single engine: {args.replicas * args.num_kv_blocks} blocks); load average (1 min) before/after")
    print(report(runs))
    for r in runs:
        for e in r.errors[:5]:
            print(f"error ({r.name}): {e}")
    summaries = [r.summary() for r in runs]
    write_plot(args.plot, lambda path: plots.plot_cluster(summaries, path))
    if args.json:
        Path(args.json).write_text(json.dumps(results_json(args, summaries), indent=2))
    return 1 if any(r.errors for r in runs) else 0


def results_json(args: argparse.Namespace, summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``--json`` writes: the command's settings and each configuration's ``Run.summary()``."""
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list)) and k != "run"}
    return {"benchmark": "cluster", "args": settings, "runs": summaries}


def add_cluster_bench_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    c = bsub.add_parser("cluster", parents=[common],
                        help="multi-turn chats on engine replicas: KV-aware vs default routing, write-through")
    c.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    c.add_argument("--conversations", type=int, default=8)
    c.add_argument("--concurrency", type=int, default=1, help="turns in flight at once (1: round-robin)")
    c.add_argument("--turns", type=int, default=6)
    c.add_argument("--doc-words", type=int, default=400, help="words of each conversation's document")
    c.add_argument("--words-per-turn", type=int, default=12, help="words quoted in each later question")
    c.add_argument("--system-words", type=int, default=150, help="words of the shared system prompt's notes")
    c.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--replica-cpus", type=float, default=0.5)
    c.add_argument("--ray-num-cpus", type=float, default=2)
    c.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    c.add_argument("--text", default=None, help="text for the turns (default botchan.txt)")
    c.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every `kvserve serve`, e.g. --server-arg=--num-kv-blocks=512 (repeatable)")
    add_engine_args(c, ("num_kv_blocks", "redis_url"), defaults={
        "num_kv_blocks": CommandDefault(256, "per replica; the single engine gets replicas x this"),
        "redis_url": CommandDefault(None, "a throwaway redis-server on loopback")})
    c.set_defaults(run=run_bench)
