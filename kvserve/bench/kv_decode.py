"""``kvserve bench kv-decode``: decode speed where reading the KV cache dominates, per KV format
and attention backend, against the memory-bandwidth limit of this machine.

Workload: ``--seqs`` requests with distinct contexts of ``--context`` tokens (slices of the
text at distinct offsets) decode ``--steps`` tokens each, all at once. Only pure decode steps
are timed (every request got one token): prefill is not part of the figure. Each repeat
submits the same prompts again, so their prefill is a prefix-cache hit and the next decode
starts at once; the figure is the median over repeats, with the spread.

The limit: a decode step reads every weight once and every request's KV once, so

    limit tok/s = seqs / ((weight bytes + KV bytes read per step) / read bandwidth)

with the read bandwidth measured in the same run (a sum over a buffer much larger than the
caches). Weights dominate a small model; KV bytes dominate long contexts and many requests.
Per configuration the table also gives the median decode step and, for a backend that
reads in place, the part of it spent in the backend's ``attend`` (every layer's calls): the
rest of the step is the weights, the per-layer work and the writes of new tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.bench.capacity import distinct_prompts
from kvserve.bench.common import load_text_model, stderr_log, table
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from kvserve.sampling_params import SamplingParams

DEFAULT_FORMATS = ("native", "fp16", "int8", "fp8", "int4", "kivi4", "kivi2")
DEFAULT_BACKENDS = ("torch", "auto")


@dataclass(frozen=True)
class DecodeResult:
    kv_format: str
    backend: str
    kv_bytes_per_step: int
    weight_bytes: int
    tok_s: list[float]            # one per repeat
    step_ms: float = 0.0          # median decode step
    attention_ms: float | None = None   # of which in the backend's attend (None: the torch path, not timed apart)

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a float32 sum streams from memory (median of ``repeats``)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a decode step reads, in the engine's weight format (LlamaModel.weight_nbytes)."""
    return llm.engine.model.weight_nbytes


def kv_bytes_per_step(llm: LLM, context_tokens: int, num_seqs: int) -> int:
    """KV bytes one decode step reads: each request's blocks in the stored format (a KIVI
    open block is read from its residual row instead: counted at the stored size)."""
    e = llm.engine
    mc, bs = e.model_config, e.pool.block_size
    per_block = e.kv_format.nbytes_per_block(bs, mc.num_kv_heads, mc.head_dim)
    return num_seqs * -(-context_tokens // bs) * per_block


class AttendTimer:
    """Wall time spent in a backend's ``attend`` (set on the instance), per engine step."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        backend = llm.engine.attention
        self.active = backend.reads_in_place
        if self.active:
            attend = backend.attend

            def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
                t = time.perf_counter()
                try:
                    return attend(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t
            backend.attend = timed        # type: ignore[method-assign]


def run_one(llm: LLM, prompts: list[list[int]], steps: int, repeats: int
            ) -> tuple[list[float], list[float], list[float]]:
    """Decode tok/s per repeat, and every timed step's wall time and time in ``attend``."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    timer = AttendTimer(llm)
    rates: list[float] = []
    step_s: list[float] = []
    attend_s: list[float] = []
    for _ in range(repeats + 1):            # the first play prefills the cache (not counted)
        for p in prompts:
            engine.add_request(p, params)
        decode_time, decode_tokens = 0.0, 0
        while engine.has_unfinished:
            before = engine.stats()
            timer.seconds = 0.0
            t = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t
            if len(outputs) == len(prompts) == before.num_running and all(len(o.token_ids) > 1 for o in outputs):
                decode_time += dt
                decode_tokens += len(outputs)
                step_s.append(dt)
                attend_s.append(timer.seconds)
        rates.append(decode_tokens / decode_time if decode_time else 0.0)
        engine.check_integrity()
    return rates[1:], step_s, attend_s


def run(loaded: LoadedModel, text_ids: list[int], formats: list[str], backends: list[str], num_seqs: int,
        context: int, steps: int, repeats: int, kv_cache_gb: float, log=print) -> list[DecodeResult]:
    prompts = distinct_prompts(text_ids, num_seqs, context, seed=0)
    results = []
    for fmt in formats:
        for backend in backends:
            llm = LLM(loaded=loaded, kv_format=fmt, attention_backend=backend, kv_cache_memory_gb=kv_cache_gb,
                      max_num_seqs=max(8, num_seqs), max_num_batched_tokens=512)
            rates, step_s, attend_s = run_one(llm, prompts, steps, repeats)
            result = DecodeResult(fmt, llm.engine.attention.name, kv_bytes_per_step(llm, context + steps // 2, num_seqs),
                                  weight_bytes(llm), rates, statistics.median(step_s) * 1e3 if step_s else 0.0,
                                  statistics.median(attend_s) * 1e3 if attend_s and llm.engine.attention.reads_in_place
                                  else None)
            log(f"{fmt} / {result.backend}: {result.median:.2f} tok/s ({', '.join(f'{r:.2f}' for r in rates)})")
            results.append(result)
            del llm
    return results


def render(results: list[DecodeResult], num_seqs: int, bandwidth: float) -> str:
    by = {(r.kv_format, r.backend): r for r in results}
    rows = []
    for r in results:
        native = by.get(("native", r.backend))
        reference = by.get((r.kv_format, "torch"))
        limit = num_seqs * bandwidth / (r.weight_bytes + r.kv_bytes_per_step)
        rows.append([r.kv_format, r.backend, f"{r.kv_bytes_per_step / 2**20:,.0f}",
                     f"{r.median:.2f}", f"{min(r.tok_s):.2f}-{max(r.tok_s):.2f}", f"{r.step_ms:.1f}",
                     "-" if r.attention_ms is None else f"{r.attention_ms:.1f}",
                     f"{r.median / native.median:.2f}x" if native else "-",
                     f"{r.median / reference.median:.2f}x" if reference and reference is not r else "-",
                     f"{limit:.2f}", f"{r.median / limit:.0%}"])
    return table(["format", "attention", "KV MiB/step", "tok/s (median)", "spread", "step ms", "of which attend ms",
                  "vs native",
                  "vs torch path", "limit tok/s", "of limit"], rows)


def run_bench(args: argparse.Namespace) -> int:
    log = stderr_log("kv-decode")
    loaded, text_ids = load_text_model(args.model, args.text, args.threads, "kv-decode")
    bandwidth = read_bandwidth()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    results = run(loaded, text_ids, args.format or list(DEFAULT_FORMATS), args.backend or list(DEFAULT_BACKENDS),
                  args.seqs, args.context, args.steps, args.repeats, args.kv_cache_gb, log)
    bandwidth = max(bandwidth, read_bandwidth())      # measured again after the runs: the box may have warmed
    w = results[0].weight_bytes if results else 0
    print(f"decode, {args.seqs} requests x {args.context} context tokens, {args.steps} steps, median of "
          f"{args.repeats}; {loaded.source}, {torch.get_num_threads()} threads; weights {w / 2**20:,.0f} MiB read "
          f"per step; read bandwidth {bandwidth / 1e9:.1f} GB/s (float32 sum over 1 GiB)")
    print(render(results, args.seqs, bandwidth))
    return 0


def add_kv_decode_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    d = bsub.add_parser("kv-decode", parents=[common],
                        help="decode tok/s per KV format and attention backend, against the bandwidth limit")
    d.add_argument("--format", action="append", default=None,
                   help="KV format (repeatable; default native, fp16, int8, fp8, int4, kivi4, kivi2)")
    d.add_argument("--backend", action="append", default=None,
                   help="attention backend (repeatable; default torch and auto)")
    d.add_argument("--seqs", type=int, default=4, help="requests decoding at once")
    d.add_argument("--context", type=int, default=4000, help="context tokens per request")
    d.add_argument("--steps", type=int, default=32, help="decode steps per request")
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--kv-cache-gb", type=float, default=1.0)
    d.add_argument("--text", default=None, help="prompt text (default: the shipped botchan.txt)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    d.set_defaults(run=run_bench)
