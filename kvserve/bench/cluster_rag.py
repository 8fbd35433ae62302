"""``kvserve bench cluster-rag``: RAG queries on engine replicas, routed by the segments a
replica stores (``--routing kv``) vs by prompt prefix only (``kv-prefix``) vs Ray Serve's
default (``pow2``), against one engine with the replicas' KV memory together (docs/cluster.md).

Each of ``--users`` users has ``--docs-per-user`` documents of its own (``bench rag``'s
documents: a planted fact each); each query gives ``k`` of its user's documents in a new
random order, each a segment (the ``segments`` field), with a question about one of them.
Another order means another prompt prefix after the first document, so a replica that stored
a user's documents holds none of the next query's prompt blocks past the chat template: only
the segments say where its KV is. Users ask at once, ``--concurrency`` queries in flight (a
FIFO semaphore), each user's queries one after another. Each replica's pool holds about its
share of the users' documents, not all of them; with a document missing, a replica computes
it standalone (and stores it) before blending, so where a query lands is what its time to
first token pays. No shared tier: routing alone decides what is found.

Per configuration: time to first token as the client sees it (streaming), the segment
tokens the replicas computed and stored (a document missing where the query landed), the
tokens blending reused, answers correct, and the share routed to the holder.

Goal (issue 25, part 3): segment-aware routing's mean TTFT below prefix-only routing's, with
fewer segment tokens computed; the physical limit is the single engine that holds everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.cluster import server_flags, serving, streamed
from kvserve.bench.common import table
from kvserve.bench.rag_workload import Document, Query, is_correct, make_documents, prompt_text
from kvserve.bench.serve import percentile
from kvserve.options import CommandDefault, add_engine_args

CONFIGS = {"single": [], "kv": ["--routing", "kv"], "kv-prefix": ["--routing", "kv-prefix"],
           "pow2": ["--routing", "pow2"]}


@dataclass
class RagRun:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    num_correct: int = 0
    prompt_tokens: int = 0
    stored_tokens: float = 0.0          # segment tokens computed standalone and stored, all replicas
    reused_tokens: float = 0.0          # prompt tokens whose KV came from a stored segment
    routed_to_holder: float | None = None
    wall_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "ttft_mean_s": statistics.fmean(self.ttft_s or [0.0]),
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p95_s": percentile(self.ttft_s, 0.95)}


def user_queries(num_users: int, docs_per_user: int, k: int, queries_per_user: int, seed: int) -> list[list[Query]]:
    """Per user: queries over ``k`` of its documents (``docs_per_user`` of them, numbered
    ``user * docs_per_user, ...``), each in a fresh random order, asking about one of them."""
    if not 1 <= k <= docs_per_user:
        raise ValueError(f"k must be in 1..{docs_per_user} (--docs-per-user), got {k}")
    rng = random.Random(seed)
    out = []
    for u in range(num_users):
        own = range(u * docs_per_user, (u + 1) * docs_per_user)
        queries = []
        for _ in range(queries_per_user):
            doc_ids = tuple(rng.sample(own, k))
            queries.append(Query(doc_ids, rng.choice(doc_ids)))
        out.append(queries)
    return out


async def _ask(client: Any, model: str, prompt: str, segments: list[str], max_tokens: int) -> tuple[float, str, int]:
    body = {"model": model, "prompt": prompt, "segments": segments, "max_tokens": max_tokens, "temperature": 0.0}
    ttft, text, usage = await streamed(client, "/v1/completions", body)
    return ttft, text, usage["prompt_tokens"]


async def play(url: str, run: RagRun, model: str, documents: list[Document], prompts: list[list[str]],
               queries: list[list[Query]], max_tokens: int, concurrency: int) -> None:
    import httpx

    slots = asyncio.Semaphore(concurrency)

    async def user(client: httpx.AsyncClient, u: int) -> None:
        for q, (query, prompt) in enumerate(zip(queries[u], prompts[u])):
            try:
                async with slots:
                    ttft, text, num_prompt = await _ask(client, model, prompt,
                                                        [documents[i].text for i in query.doc_ids], max_tokens)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails
                run.errors.append(f"user {u} query {q}: {e}")
                return
            run.ttft_s.append(ttft)
            run.prompt_tokens += num_prompt
            run.num_correct += is_correct(text, documents[query.target].number)

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _ask(client, model, "Warm-up.", ["Warm-up."], 2)      # first-call costs, a blend's included
        await asyncio.gather(*(user(client, u) for u in range(len(queries))))
    run.wall_s = time.perf_counter() - start


def read_metrics(text: str, run: RagRun, single: bool) -> None:
    """The segment counters of a ``/metrics`` page into ``run``: the single server's series,
    or the ingress's per-replica ones (summed), and the share routed to the holder."""
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if single and name == "kvserve_segment_stored_tokens_total":
            run.stored_tokens += float(value)
        elif single and name == "kvserve_blend_reused_tokens_total":
            run.reused_tokens += float(value)
        elif name.startswith("kvserve_cluster_replica_segment_tokens_total{"):
            if 'kind="stored"' in name:
                run.stored_tokens += float(value)
            else:
                run.reused_tokens += float(value)
        elif name == "kvserve_cluster_routed_to_holder_ratio":
            run.routed_to_holder = float(value)


def scrape(url: str, run: RagRun, single: bool) -> None:
    import httpx

    read_metrics(httpx.get(f"{url}/metrics", timeout=30).text, run, single)


def run_config(name: str, args: argparse.Namespace, documents: list[Document], prompts: list[list[str]],
               queries: list[list[Query]]) -> RagRun:
    run = RagRun(name, load_before=os.getloadavg()[0])
    with serving(server_flags(args, name == "single", CONFIGS[name])) as url:
        asyncio.run(play(url, run, args.served_model_name, documents, prompts, queries, args.max_tokens,
                         args.concurrency))
        time.sleep(2.5)      # the replicas' stats reach the ingress's /metrics within a poll
        scrape(url, run, name == "single")
    run.load_after = os.getloadavg()[0]
    return run


def report(runs: list[RagRun], num_queries: int) -> str:
    ms = lambda s: f"{s * 1000:,.0f}"
    rows = [[r.name, ms(statistics.fmean(r.ttft_s or [0.0])), ms(percentile(r.ttft_s, 0.5)),
             ms(percentile(r.ttft_s, 0.95)), f"{r.stored_tokens:,.0f}", f"{r.reused_tokens:,.0f}",
             f"{r.num_correct}/{num_queries}",
             "-" if r.routed_to_holder is None or r.name in ("single", "pow2") else f"{r.routed_to_holder:.0%}",
             f"{r.wall_s:.1f}", f"{r.load_before:.1f} / {r.load_after:.1f}"] for r in runs]
    lines = [table(["config", "TTFT mean ms", "p50", "p95", "segment tokens computed", "reused", "correct",
                    "to holder", "wall s", "load before/after"], rows)]
    by = {r.name: r for r in runs}
    mean = lambda n: statistics.fmean(by[n].ttft_s) if by[n].ttft_s else float("nan")
    for base in ("kv-prefix", "pow2"):
        if "kv" in by and base in by:
            lines.append(f"mean TTFT {base} / kv = {mean(base) / mean('kv'):.2f}x; segment tokens computed "
                         f"{by[base].stored_tokens:,.0f} vs {by['kv'].stored_tokens:,.0f}")
    if "kv" in by and "single" in by:
        lines.append(f"limit: one engine holding every document, mean TTFT kv / single = "
                     f"{mean('kv') / mean('single'):.2f}x")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import find_text, write_plot
    from kvserve.model.loader import load_model

    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    tokenizer = load_model(args.model).tokenizer
    if tokenizer is None:
        raise ValueError("bench cluster-rag needs a model with a tokenizer (the documents are text)")
    documents = make_documents(find_text(args.text), tokenizer, args.users * args.docs_per_user, args.doc_tokens,
                               args.workload_seed)
    queries = user_queries(args.users, args.docs_per_user, args.k, args.queries_per_user, args.workload_seed)
    prompts = [[prompt_text(tokenizer, documents, q) for q in qs] for qs in queries]
    num_queries = sum(len(qs) for qs in queries)
    runs = []
    for name in names:
        run = run_config(name, args, documents, prompts, queries)
        print(f"{name}: {len(run.ttft_s)} queries, mean TTFT {statistics.fmean(run.ttft_s or [0]) * 1000:,.0f} ms, "
              f"{run.stored_tokens:,.0f} segment tokens computed, {len(run.errors)} errors, {run.wall_s:.1f} s",
              flush=True)
        runs.append(run)
    doc_tokens = sum(d.num_tokens for d in documents)
    print(f"kvserve bench cluster-rag: {args.users} users x {args.queries_per_user} queries of k={args.k} of their "
          f"{args.docs_per_user} documents ({doc_tokens:,} document tokens in all, ~{args.doc_tokens} each), "
          f"{args.concurrency} in flight, {args.max_tokens} tokens per answer, {runs[0].prompt_tokens:,} prompt "
          f"tokens; {args.replicas} replicas of {args.num_kv_blocks} KV blocks at {args.replica_cpus} CPU each on a "
          f"{args.ray_num_cpus}-CPU Ray (single engine: {args.replicas * args.num_kv_blocks} blocks); "
          f"load average (1 min) before/after")
    print(report(runs, num_queries))
    for r in runs:
        for e in r.errors[:5]:
            print(f"error ({r.name}): {e}")
    write_plot(args.plot, lambda path: plots.plot_cluster_rag([r.summary() for r in runs], path))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list)) and k != "run"}
        Path(args.json).write_text(json.dumps({"benchmark": "cluster-rag", "args": settings,
                                               "runs": [r.summary() for r in runs]}, indent=2))
    return 1 if any(r.errors for r in runs) else 0


def add_cluster_rag_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    c = bsub.add_parser("cluster-rag", parents=[common],
                        help="RAG queries on engine replicas: routing by stored segments vs by prefix vs default")
    c.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    c.add_argument("--users", type=int, default=5)
    c.add_argument("--docs-per-user", type=int, default=4)
    c.add_argument("--k", type=int, default=4, help="documents per query (of its user's)")
    c.add_argument("--queries-per-user", type=int, default=6)
    c.add_argument("--doc-tokens", type=int, default=300)
    c.add_argument("--concurrency", type=int, default=2, help="queries in flight at once")
    c.add_argument("--max-tokens", type=int, default=8, help="answer length")
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--replica-cpus", type=float, default=0.5)
    c.add_argument("--ray-num-cpus", type=float, default=2)
    c.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    c.add_argument("--text", default=None, help="text of the documents (default botchan.txt)")
    c.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    c.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for every `kvserve serve`, e.g. --server-arg=--blend-selection=query (repeatable)")
    add_engine_args(c, ("num_kv_blocks",), defaults={"num_kv_blocks": CommandDefault(400, "per replica; the single engine gets replicas x this")})
    c.set_defaults(run=run_bench)
