"""``kvserve bench capacity``: how many long requests one KV pool holds at once, per format.

The pool is fixed in bytes (``--kv-cache-gb``). For each format the engine is given
``max_num_seqs`` just large enough not to be the limit (under a quantized format every
seat reserves full-precision residual rows out of the same pool, so "very large" would
shrink the pool; the smallest S with S >= requests-that-fit(S) is found by search).
Then ``num_requests`` distinct prompts of ``prompt_tokens`` tokens (slices of the text
at distinct offsets: no shared prefix) are submitted at once, each generating exactly
``max_tokens`` tokens (eos ignored), and the engine is stepped to the end.

Per step we record the requests that got a token (their whole sequence is in the
cache) and the engine's running count. *Peak concurrent* is the most requests that
got a token in one step. *Decode tok/s* is measured over pure decode steps (every
running request got exactly one token, nobody was admitted or preempted) at the peak
batch: tokens / wall time of those steps. *End-to-end tok/s* is every generated token
over the whole run's wall time (prefills, admissions and the tail included), compared
with native's on the same attention backend (``--backend``, repeatable). *Default seats*
says whether the format's engine starts on this pool with the default ``max_num_seqs``.

``max_tokens`` must outlast the prefill of the whole first wave, or requests finish
before the pool fills (with 512 tokens per step, ~70 steps for 36 prompts of 1,000).

On a model with sliding-window layers (Gemma 3) a request holds only its windows' blocks in those
layers (kv/groups.py): ``blocks per request`` is the most it holds at once, and ``KV bytes/token``
what that costs per token of its length. ``--whole-layers`` runs each format a second time with
every layer's blocks whole (``--no-window-kv``: the allocation of an engine without layer groups),
in the same run, so the two layouts are compared on the same pool.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.bench.common import table
from kvserve.llm import LLM
from kvserve.options import CommandDefault, add_engine_args
from kvserve.sampling_params import SamplingParams

MakeLLM = Callable[[int | None], LLM]   # max_num_seqs (None: the default) -> an engine with that many seats


@dataclass(frozen=True)
class CapacityResult:
    kv_format: str
    backend: str
    spec: str
    bytes_per_token: float
    num_blocks: int
    max_num_seqs: int
    blocks_per_request: int
    num_requests: int
    peak_concurrent: int        # most requests that got a token in one step
    peak_running: int           # most requests the engine held as running (some mid-prefill)
    decode_batch: int           # batch of the pure decode steps measured
    decode_steps: int
    decode_tok_s: float
    num_preemptions: int
    wall_s: float
    generated_tokens: int = 0
    default_seats: str = ""      # "yes", or why the engine refused the default max_num_seqs
    layout: str = "window"       # sliding layers' blocks: their window's ("window") or all ("whole")
    held_bytes_per_token: float = 0.0   # a request's most KV bytes at once over its tokens

    @property
    def e2e_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def fit(self) -> int:
        """Requests whose whole sequence fits in the pool at once (by block count)."""
        return self.num_blocks // self.blocks_per_request


def blocks_per_request(llm: LLM, prompt_tokens: int, max_tokens: int) -> int:
    """The most blocks one request holds at once (with sliding layers: their windows' only)."""
    return llm.engine.kv.max_blocks_held(prompt_tokens + max_tokens)


def fitting_max_num_seqs(make: MakeLLM, request_blocks: int, log: Callable[[str], None]) -> tuple[int, LLM]:
    """The smallest S with S >= pool blocks(S) // request_blocks, and its engine.

    blocks(S) does not grow with S, so the predicate is monotone: binary search. An S
    whose residual rows leave no room for a block (the engine refuses it) fits 0."""
    def fit(max_num_seqs: int) -> int:
        try:
            return make(max_num_seqs).engine.kv.num_blocks // request_blocks
        except ValueError:
            return 0

    lo, hi = 1, max(1, fit(1))       # S = fit(1) always satisfies S >= fit(S)
    while lo < hi:
        mid = (lo + hi) // 2
        if mid >= fit(mid):
            hi = mid
        else:
            lo = mid + 1
    llm = make(lo)
    log(f"{llm.engine.kv_format.spec}: max_num_seqs {lo}, {llm.engine.kv.num_blocks} blocks, "
        f"{llm.engine.kv.num_blocks // request_blocks} requests fit")
    return lo, llm


def distinct_prompts(token_ids: list[int], count: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``count`` slices of ``prompt_tokens`` tokens at distinct offsets (no two share a first block)."""
    room = len(token_ids) - prompt_tokens
    if room < count:
        raise ValueError(f"the text has {len(token_ids)} tokens: too few for {count} prompts of {prompt_tokens}")
    offsets = random.Random(seed).sample(range(room), count)
    return [token_ids[o:o + prompt_tokens] for o in offsets]


def run_format(llm: LLM, kv_format: str, max_num_seqs: int, prompts: list[list[int]], max_tokens: int,
               request_blocks: int, default_seats: str = "", layout: str = "window") -> CapacityResult:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    peak_concurrent = peak_running = 0
    decode_steps: dict[int, list[float]] = {}     # batch -> step times of pure decode steps
    while engine.has_unfinished:
        before = engine.stats()
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        after = engine.stats()
        peak_concurrent = max(peak_concurrent, len(outputs))
        peak_running = max(peak_running, after.num_running, before.num_running)
        is_pure_decode = (len(outputs) == before.num_running and after.num_waiting == before.num_waiting
                          and after.num_preemptions == before.num_preemptions)
        if is_pure_decode and outputs:
            decode_steps.setdefault(len(outputs), []).append(dt)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    batch = peak_concurrent if peak_concurrent in decode_steps else max(decode_steps, default=0)
    times = decode_steps.get(batch, [])
    mc = engine.model_config
    bs = engine.config.cache.block_size
    return CapacityResult(
        kv_format=kv_format, backend=engine.runner.backend.name, spec=engine.kv_format.spec,
        bytes_per_token=engine.kv_format.nbytes_per_block(bs, mc.num_kv_heads, mc.head_dim) / bs,
        num_blocks=engine.kv.num_blocks, max_num_seqs=max_num_seqs, blocks_per_request=request_blocks,
        num_requests=len(prompts), peak_concurrent=peak_concurrent, peak_running=peak_running,
        decode_batch=batch, decode_steps=len(times),
        decode_tok_s=batch * len(times) / sum(times) if times else 0.0,
        num_preemptions=engine.stats().num_preemptions, wall_s=wall,
        generated_tokens=len(prompts) * max_tokens, default_seats=default_seats, layout=layout,
        held_bytes_per_token=request_blocks * engine.runner.cache.nbytes / engine.kv.num_blocks
        / (len(prompts[0]) + max_tokens))


def render(results: list[CapacityResult]) -> str:
    native = {(r.backend, r.layout): r for r in results if r.kv_format == "native"}
    headers = ["format", "attention", "bytes/token", "KV bytes/token held", "max_num_seqs", "default seats",
               "blocks in pool", "blocks / request", "fit", "peak concurrent", "decode batch", "decode tok/s",
               "end-to-end tok/s", "vs native", "preemptions", "wall (s)"]
    rows = []
    for r in results:
        base = native.get((r.backend, r.layout))
        name = r.kv_format if r.layout == "window" else f"{r.kv_format} (every layer whole)"
        rows.append([name, r.backend, f"{r.bytes_per_token:,.0f}", f"{r.held_bytes_per_token:,.0f}", r.max_num_seqs,
                     r.default_seats, f"{r.num_blocks:,}", r.blocks_per_request, r.fit, r.peak_concurrent,
                     r.decode_batch,
                     f"{r.decode_tok_s:.1f}" if r.decode_steps else "—", f"{r.e2e_tok_s:.1f}",
                     f"{r.e2e_tok_s / base.e2e_tok_s:.2f}x" if base and base.e2e_tok_s else "-",
                     r.num_preemptions, f"{r.wall_s:.0f}"])
    return table(headers, rows)


DEFAULT_FORMATS = ("native", "fp16", "int8", "int4", "kivi4", "kivi2")


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvserve.bench import plots
    from kvserve.bench.common import load_text_model, stderr_log, write_plot

    log = stderr_log("capacity")
    loaded, text_ids = load_text_model(args.model, args.text, args.threads, "capacity")
    results = []
    layouts = ["window", "whole"] if args.whole_layers else ["window"]
    configs = [(fmt, backend, layout) for backend in args.backend or ["auto"]
               for fmt in args.format or list(DEFAULT_FORMATS) for layout in layouts]
    for fmt, backend, layout in configs:
        def make(max_num_seqs: int | None, fmt: str = fmt, backend: str = backend, layout: str = layout) -> LLM:
            seats: dict[str, Any] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
            return LLM(loaded=loaded, kv_format=fmt, kv_cache_memory_gb=args.kv_cache_memory_gb,
                       max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=backend,
                       device=args.device, dtype=args.dtype, window_kv=layout == "window", **seats)

        try:
            default_engine = make(None)
            default_seats = "yes"
            del default_engine
        except ValueError as e:
            default_seats = f"no: {e}"

        request_blocks = blocks_per_request(make(1), args.prompt_tokens, args.max_tokens)
        seqs, llm = fitting_max_num_seqs(make, request_blocks, log)
        fit = llm.engine.kv.num_blocks // request_blocks
        if fit < 1:
            raise ValueError(f"{fmt}: a request of {args.prompt_tokens} + {args.max_tokens} tokens needs "
                             f"{request_blocks} blocks; the pool has {llm.engine.kv.num_blocks}")
        count = args.num_requests or fit + max(2, fit // 4)
        prompts = distinct_prompts(text_ids, count, args.prompt_tokens, args.workload_seed)
        log(f"{fmt}: {count} requests of {args.prompt_tokens} tokens + {args.max_tokens} new")
        result = run_format(llm, fmt, seqs, prompts, args.max_tokens, request_blocks, default_seats, layout)
        log(f"{fmt} / {result.backend}: peak {result.peak_concurrent} concurrent, decode {result.decode_tok_s:.1f} "
            f"tok/s at batch {result.decode_batch}, end to end {result.e2e_tok_s:.1f} tok/s, {result.wall_s:.0f} s")
        results.append(result)
        del llm
    engine_desc = f"device {args.device}, dtype {args.dtype}"
    print(f"KV capacity: pool {args.kv_cache_memory_gb} GiB, requests of {args.prompt_tokens} prompt + {args.max_tokens} "
          f"generated tokens, {args.max_num_batched_tokens} tokens per step, {loaded.source}, {engine_desc}")
    print(render(results))
    write_plot(args.plot, lambda path: plots.plot_capacity(results, path))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0


def add_capacity_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    c = bsub.add_parser("capacity", parents=[common],
                        help="requests of 1,000 tokens held at once per KV format, and decode tok/s at that batch")
    c.add_argument("--format", action="append", default=None,
                   help=f"KV format spec (repeatable; default: {', '.join(DEFAULT_FORMATS)})")
    c.add_argument("--backend", action="append", default=None,
                   help="attention backend (repeatable; default auto)")
    c.add_argument("--prompt-tokens", type=int, default=1000)
    c.add_argument("--max-tokens", type=int, default=128,
                   help="tokens generated per request (must outlast the first wave's prefill)")
    c.add_argument("--num-requests", type=int, default=None,
                   help="requests submitted (default: those that fit plus a quarter)")
    c.add_argument("--text", default=None, help="prompt text (default: the shipped botchan.txt)")
    c.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    c.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    c.add_argument("--whole-layers", action="store_true",
                   help="also run each format with every layer's blocks whole (--no-window-kv), on a model with "
                        "sliding-window layers: the two layouts on the same pool")
    add_engine_args(c, ("kv_cache_memory_gb", "max_num_batched_tokens"), defaults={
        "kv_cache_memory_gb": CommandDefault(0.25, "the fixed pool every format fills, small to keep the run short")})
    c.set_defaults(run=run_bench)
