"""``kvserve bench serve``: a bounded load test of the HTTP server.

Starts ``kvserve serve`` on a free loopback port in a subprocess (so its memory is its
own), then runs ``num_requests`` streaming requests from ``concurrency`` clients at
once: chat and completions alternately, each a shared document (one of a few, of
different lengths: shared prefixes) plus a unique question (mixed prompt lengths),
greedy, ``ignore_eos`` so every answer has exactly ``max_tokens`` tokens.

Every response is checked: HTTP 200, well-formed events ending in ``[DONE]``, no error
event, ``finish_reason == "length"``, usage with the prompt's exact token count (our own
tokenizer's), ``completion_tokens == max_tokens`` and ``cached_tokens <= prompt_tokens``.
Any failure is reported and makes the command exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:   # httpx is imported when a load runs: building the CLI parser must not need it
    import httpx

DOC_WORDS = (40, 120, 250, 400)   # the shared documents: mixed prefix lengths


@dataclass(frozen=True)
class Job:
    path: str                 # /v1/chat/completions or /v1/completions
    body: dict[str, Any]
    num_prompt_tokens: int    # what usage must report
    group: int                # jobs with the same prompt (greedy: the same text)


@dataclass
class LoadResult:
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    num_ok: int = 0
    errors: list[str] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    texts: dict[int, list[str]] = field(default_factory=dict)

    @property
    def greedy_agreement(self) -> float:
        """Fraction of repeated prompts whose answers were all identical."""
        groups = [t for t in self.texts.values() if len(t) > 1]
        return sum(len(set(t)) == 1 for t in groups) / len(groups) if groups else 1.0


def make_jobs(tokenizer: Tokenizer, text: str, num_requests: int, max_tokens: int, model: str,
              doc_words: tuple[int, ...] = DOC_WORDS, num_questions: int = 48, seed: int = 0) -> list[Job]:
    """Chat and completions alternately; prompt = document (shared) + question (unique-ish)."""
    words = re.sub(r"\s+", " ", text).split(" ")
    docs = [" ".join(words[i * 500:i * 500 + n]) for i, n in enumerate(doc_words)]
    rng = random.Random(seed)
    questions = []
    for q in range(num_questions):
        start = rng.randrange(0, len(words) - 60)
        questions.append(f"Question {q}: what does this add: {' '.join(words[start:start + rng.randrange(3, 40)])}?")
    jobs = []
    for i in range(num_requests):
        q = rng.randrange(num_questions)
        d = q % len(docs)
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
        if i % 2 == 0:
            messages = [{"role": "system", "content": f"Answer about this text:\n{docs[d]}"},
                        {"role": "user", "content": questions[q]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            jobs.append(Job("/v1/chat/completions", {**common, "messages": messages},
                            len(tokenizer.encode(prompt)), 2 * q))
        else:
            prompt = f"{docs[d]}\n\n{questions[q]}\nAnswer:"
            jobs.append(Job("/v1/completions", {**common, "prompt": prompt}, len(tokenizer.encode(prompt)),
                            2 * q + 1))
    return jobs


async def _one(client: httpx.AsyncClient, job: Job, result: LoadResult) -> None:
    t0 = time.perf_counter()
    ttft, pieces, usage, finish, done = None, [], None, None, False
    async with client.stream("POST", job.path, json=job.body) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                raise AssertionError(f"error event: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(piece)
                finish = choice.get("finish_reason") or finish
    problems = []
    if not done:
        problems.append("no [DONE]")
    if finish != "length":
        problems.append(f"finish_reason {finish!r}")
    if usage is None:
        problems.append("no usage")
    else:
        if usage["prompt_tokens"] != job.num_prompt_tokens:
            problems.append(f"prompt_tokens {usage['prompt_tokens']} != {job.num_prompt_tokens}")
        if usage["completion_tokens"] != job.body["max_tokens"]:
            problems.append(f"completion_tokens {usage['completion_tokens']} != {job.body['max_tokens']}")
        if not 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]:
            problems.append(f"cached_tokens {usage['prompt_tokens_details']['cached_tokens']}")
    if problems:
        raise AssertionError("; ".join(problems))
    assert usage is not None
    result.num_ok += 1
    result.ttft_s.append(ttft if ttft is not None else time.perf_counter() - t0)
    result.e2e_s.append(time.perf_counter() - t0)
    result.output_tokens += usage["completion_tokens"]
    result.prompt_tokens += usage["prompt_tokens"]
    result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    result.texts.setdefault(job.group, []).append("".join(pieces))


async def run_load(base_url: str, jobs: list[Job], concurrency: int, deadline_s: float,
                   api_key: str | None = None) -> LoadResult:
    """``concurrency`` clients take jobs in order until none is left or the deadline passes."""
    import httpx

    result = LoadResult()
    pending = list(reversed(jobs))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            job = pending.pop()
            try:
                await _one(client, job, result)
            except Exception as e:  # noqa: BLE001 - every failure is a reported error
                result.errors.append(f"{job.path}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(deadline_s)) as client:
        tasks = [asyncio.ensure_future(client_loop(client)) for _ in range(concurrency)]
        _, late = await asyncio.wait(tasks, timeout=deadline_s)
        for t in late:
            t.cancel()
    result.wall_s = time.perf_counter() - t0
    missing = len(jobs) - result.num_ok - len(result.errors)
    if missing:
        result.errors.append(f"{missing} requests not finished within {deadline_s:.0f} s")
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, extra: list[str], timeout_s: float = 120.0) -> subprocess.Popen[bytes]:
    import httpx

    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "KVSERVE_API_KEY": ""})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"the server did not become healthy within {timeout_s:.0f} s")


def report(result: LoadResult, num_jobs: int, concurrency: int) -> str:
    ms = lambda v: f"{v * 1000:.0f} ms"
    wall = max(result.wall_s, 1e-9)
    lines = [
        f"requests: {result.num_ok}/{num_jobs} ok, {len(result.errors)} errors, {concurrency} concurrent clients",
        (f"wall time: {result.wall_s:.1f} s; throughput {result.num_ok / wall:.2f} req/s, "
         f"{result.output_tokens / wall:.1f} output tok/s"),
        (f"TTFT p50 {ms(percentile(result.ttft_s, 0.5))}, p95 {ms(percentile(result.ttft_s, 0.95))}; "
         f"end-to-end p50 {ms(percentile(result.e2e_s, 0.5))}, p95 {ms(percentile(result.e2e_s, 0.95))}"),
        (f"prompt tokens {result.prompt_tokens}, of which cached {result.cached_tokens} "
         f"({result.cached_tokens / max(result.prompt_tokens, 1):.0%})"),
        f"greedy agreement among repeated prompts: {result.greedy_agreement:.0%}",
    ]
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    import httpx

    from kvserve.bench import plots
    from kvserve.bench.common import find_text, write_plot
    from kvserve.model.loader import default_model_name, load_model

    tokenizer = load_model(args.model).tokenizer
    jobs = make_jobs(tokenizer, find_text(args.text), args.num_requests, args.max_tokens,
                     default_model_name(args.model))
    port = free_port()
    extra = [*(["--model", args.model] if args.model else []), "--device", args.device, "--dtype", args.dtype,
             *args.server_arg]
    proc = start_server(port, extra)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run_load(url, jobs[:2], 2, 120.0))   # warm-up (first-call costs)
        rss_before = rss_mib(proc.pid)
        result = asyncio.run(run_load(url, jobs, args.concurrency, args.deadline_s))
        rss_after = rss_mib(proc.pid)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"kvserve bench serve: {len(jobs)} streaming requests (chat/completions), max_tokens {args.max_tokens}")
    print(report(result, len(jobs), args.concurrency))
    print(f"server RSS: {rss_before or float('nan'):.0f} MiB before, {rss_after or float('nan'):.0f} MiB after")
    for line in metrics.splitlines():
        if line.startswith(("kvserve_engine_steps_total", "kvserve_preemptions_total",
                            "kvserve_prefix_cache_hit_tokens_total", "kvserve_prefix_cache_query_tokens_total")):
            print(f"server {line}")
    for e in result.errors[:10]:
        print(f"error: {e}")
    write_plot(args.plot, lambda path: plots.plot_serve(
        result.ttft_s, result.e2e_s, path, f"kvserve bench serve: {result.num_ok} requests, {args.concurrency} clients"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "serve", "num_requests": len(jobs), "concurrency": args.concurrency,
            "ok": result.num_ok, "errors": result.errors, "wall_s": result.wall_s,
            "ttft_p50_s": percentile(result.ttft_s, 0.5), "ttft_p95_s": percentile(result.ttft_s, 0.95),
            "output_tokens": result.output_tokens, "rss_before_mib": rss_before, "rss_after_mib": rss_after,
            "median_e2e_s": statistics.median(result.e2e_s) if result.e2e_s else None}, indent=2))
    return 1 if result.errors else 0


def add_serve_bench_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    s = bsub.add_parser("serve", parents=[common], help="bounded load test of the HTTP server (streaming clients)")
    s.add_argument("--num-requests", type=int, default=256)
    s.add_argument("--concurrency", type=int, default=32, help="clients sending at once")
    s.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (exact: eos is ignored)")
    s.add_argument("--deadline-s", type=float, default=600.0, help="give up (and fail) after this long")
    s.add_argument("--text", default=None, help="text for documents and questions (default botchan.txt)")
    s.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for `kvserve serve`, e.g. --server-arg=--no-prefix-caching (repeatable)")
    s.set_defaults(run=run_bench)
