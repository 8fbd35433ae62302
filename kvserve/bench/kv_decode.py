"""``kvserve bench kv-decode``: decode speed where reading the KV cache dominates, per KV format
and attention backend, against the memory-bandwidth limit of this machine.

Workload: ``--seqs`` requests with distinct contexts of ``--context`` tokens (slices of the
text at distinct offsets) decode ``--steps`` tokens each, all at once. Only pure decode steps
are timed (every request got one token): prefill is not part of the figure. Each repeat
submits the same prompts again, so their prefill is a prefix-cache hit and the next decode
starts at once; the figure is the median over repeats, with the spread. With ``--interleave``
the repeats are played in rounds, every configuration once a round (all engines held at once),
so a box whose load drifts during the run slows every row alike; each row then also gets its
rate over the first row's in the same round (median and spread over the rounds), the figure
to compare formats by on a shared machine.

The limit: a decode step reads every weight once and every request's KV once, so

    limit tok/s = seqs / ((weight bytes + KV bytes read per step) / read bandwidth)

with the read bandwidth measured in the same run (a sum over a buffer much larger than the
caches). Weights dominate a small model; KV bytes dominate long contexts and many requests.
Per configuration the table also gives the median decode step and, for a backend that
reads in place, the part of it spent in the backend's ``attend`` (every layer's calls): the
rest of the step is the weights, the per-layer work and the writes of new tokens.

On CUDA (``--device cuda``) the bandwidth is the device's (a sum over a buffer in its memory),
the step is not taken apart (launches return before the work is done), and ``--graphs on|both``
adds rows whose decode steps replay CUDA graphs (``--cuda-graphs``, docs/attention.md): the
same configuration eager and with graphs, in the same run. ``--random-model SHAPE`` times a
model of a real shape with random weights (kvserve/bench/random_model.py: no file needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvserve.bench.capacity import distinct_prompts
from kvserve.bench.common import load_text_model, stderr_log, table, write_plot
from kvserve.bench.random_model import SHAPES, random_model, random_token_ids
from kvserve.engine.build import resolve_device
from kvserve.engine.graphs import DecodeGraphs
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from kvserve.options import add_engine_args, engine_options
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
    products_ms: float | None = 0.0     # of which in the weight products (None: not taken apart, CUDA)
    weight_format: str = ""
    vs_first: list[float] | None = None   # with --interleave: tok/s over the first row's, per round
    graphs: bool = False          # decode steps replayed from CUDA graphs
    graph_steps: float | None = None    # with graphs: the share of decode steps that replayed one

    @property
    def rest_ms(self) -> float | None:
        """The step less its products and attention (None where attention is not timed apart)."""
        if self.attention_ms is None or self.products_ms is None:
            return None
        return self.step_ms - self.products_ms - self.attention_ms

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second a float32 sum streams from ``device``'s memory (median of ``repeats``)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum().item()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum().item()      # .item(): the sum done, on a device too
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a decode step reads, in the engine's weight format (Decoder.weight_nbytes)."""
    return llm.engine.model.weight_nbytes


def kv_bytes_per_step(llm: LLM, context_tokens: int, num_seqs: int) -> int:
    """KV bytes one decode step reads: each request's blocks in the stored format (a KIVI
    open block is read from its residual row instead: counted at the stored size)."""
    e = llm.engine
    mc, bs = e.model_config, e.config.cache.block_size
    per_block = e.kv_format.nbytes_per_block(bs, mc.num_kv_heads, mc.head_dim)
    return num_seqs * -(-context_tokens // bs) * per_block


PRODUCT_METHODS = ("__call__", "after_norm", "add_into", "swiglu_add_into", "head")


class StepTimer:
    """Wall time per engine step spent in the backend's ``attend`` and in the model's products
    (every layer's and the LM head's calls, set on the instances, and the calls a family's direct
    loop binds from them: ``Product.bound``, ``step_attend``); the rest of a step is the norms'
    and RoPE's remains, the KV writes, the per-layer Python, scheduling, sampling, and these
    timers' own calls."""

    def __init__(self, llm: LLM) -> None:
        self.attend_s = 0.0
        self.products_s = 0.0
        backend = llm.engine.runner.backend
        # on a device, calls return before their work is done: the step is not taken apart there
        self.splits = llm.engine.device.type == "cpu"
        self.times_attention = backend.reads_in_place and self.splits
        if not self.splits:
            return
        if self.times_attention:
            backend.attend = self._timed(backend.attend, "attend_s")   # type: ignore[method-assign]
            backend.step_attend = self._timing(backend.step_attend, "attend_s")   # type: ignore[method-assign]
        model = llm.engine.model
        for product in [model.lm_head, *model.layer_products()]:
            for name in PRODUCT_METHODS:
                setattr(product, name, self._timed(getattr(product, name), "products_s"))
            product.bound = self._timing(product.bound, "products_s")    # type: ignore[method-assign]
        model.forget_bound_calls()     # a family's direct loop binds the timed calls

    def _timed(self, fn: Any, counter: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - t)
        return timed

    def _timing(self, bind: Any, counter: str) -> Any:
        """``bind`` whose returned calls are timed (``Product.bound``, ``step_attend``)."""
        def timed_bind(*args: Any, **kwargs: Any) -> Any:
            call = bind(*args, **kwargs)
            return None if call is None else self._timed(call, counter)
        return timed_bind

    def reset(self) -> None:
        self.attend_s = self.products_s = 0.0


class StepTimes(NamedTuple):
    rates: list[float]         # decode tok/s per repeat
    step_s: list[float]        # every timed step's wall time
    attend_s: list[float]      # of which in attend
    products_s: list[float]    # of which in the products


class Player:
    """One configuration's engine: the prompts played once at the start to fill its cache (not
    counted); each ``play`` submits them again (a prefix-cache hit) and records the decode tok/s
    and every pure decode step's wall time, time in ``attend`` and in the products."""

    def __init__(self, llm: LLM, prompts: list[list[int]], steps: int) -> None:
        self.llm, self.prompts = llm, prompts
        self.params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        self.timer = StepTimer(llm)
        self.times = StepTimes([], [], [], [])
        self._play(StepTimes([], [], [], []))

    def play(self) -> None:
        """One repeat, recorded."""
        self._play(self.times)

    def _play(self, out: StepTimes) -> None:
        engine, prompts = self.llm.engine, self.prompts
        for p in prompts:
            engine.add_request(p, self.params)
        decode_time, decode_tokens = 0.0, 0
        while engine.has_unfinished:
            before = engine.stats()
            self.timer.reset()
            t = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t
            if len(outputs) == len(prompts) == before.num_running and all(len(o.token_ids) > 1 for o in outputs):
                decode_time += dt
                decode_tokens += len(outputs)
                out.step_s.append(dt)
                out.attend_s.append(self.timer.attend_s)
                out.products_s.append(self.timer.products_s)
        out.rates.append(decode_tokens / decode_time if decode_time else 0.0)
        engine.check_integrity()


def run(loaded: LoadedModel, text_ids: list[int], formats: list[str], backends: list[str], num_seqs: int,
        context: int, steps: int, repeats: int, kv_cache_gb: float, log=print,
        engine_options: dict[str, Any] | None = None, interleave: bool = False,
        graphs: tuple[bool, ...] = (False,)) -> list[DecodeResult]:
    """``engine_options``: further ``LLM(...)`` keywords (device, dtype, weight_format). With
    ``interleave``: every engine is built first, then the repeats run in rounds. ``graphs``: each
    configuration eager (False) and / or with CUDA graphs (True)."""
    prompts = distinct_prompts(text_ids, num_seqs, context, seed=0)
    configs = [(fmt, backend, g) for fmt in formats for backend in backends for g in graphs]

    def engine(fmt: str, backend: str, with_graphs: bool) -> LLM | None:
        """The configuration's engine; None for a graphs row the engine refuses (logged: a KIVI
        format's steps never fit a graph, and its eager row still runs)."""
        try:
            return LLM(loaded=loaded, kv_format=fmt, attention_backend=backend, kv_cache_memory_gb=kv_cache_gb,
                       max_num_seqs=max(8, num_seqs), max_num_batched_tokens=512, cuda_graphs=with_graphs,
                       **(engine_options or {}))
        except ValueError as e:
            if not with_graphs or not str(e).startswith("cuda_graphs:"):
                raise
            log(f"{fmt} / {backend}: no row with CUDA graphs ({e})")
            return None

    def result(fmt: str, player: Player, vs_first: list[float] | None = None) -> DecodeResult:
        llm, times = player.llm, player.times
        timed_attention = bool(times.attend_s) and llm.engine.runner.backend.reads_in_place
        step_graphs = llm.engine.runner.graphs
        graph_share = None
        if isinstance(step_graphs, DecodeGraphs):
            ran = step_graphs.stats.replayed_steps + step_graphs.stats.eager_steps
            graph_share = step_graphs.stats.replayed_steps / ran if ran else 0.0

        def median_ms(xs: list[float]) -> float:
            return statistics.median(xs) * 1e3 if xs else 0.0

        return DecodeResult(fmt, llm.engine.runner.backend.name, kv_bytes_per_step(llm, context + steps // 2, num_seqs),
                            weight_bytes(llm), times.rates, median_ms(times.step_s),
                            median_ms(times.attend_s) if timed_attention else None,
                            median_ms(times.products_s) if player.timer.splits else None, llm.engine.weight_format,
                            vs_first, graph_share is not None, graph_share)

    def rates(r: DecodeResult) -> str:
        return f"{r.median:.2f} tok/s ({', '.join(f'{x:.2f}' for x in r.tok_s)})"

    results = []
    if not interleave:
        for fmt, backend, g in configs:
            llm = engine(fmt, backend, g)
            if llm is None:
                continue
            player = Player(llm, prompts, steps)
            for _ in range(repeats):
                player.play()
            results.append(result(fmt, player))
            log(f"{fmt} / {results[-1].backend}: {rates(results[-1])}")
            del player
        return results
    built = [(fmt, engine(fmt, backend, g)) for fmt, backend, g in configs]
    players = [(fmt, Player(llm, prompts, steps)) for fmt, llm in built if llm is not None]
    for i in range(repeats):
        for _, player in players:
            player.play()
        log(f"round {i + 1}: " + ", ".join(f"{fmt} / {p.llm.engine.runner.backend.name} {p.times.rates[-1]:.2f}"
                                           for fmt, p in players))
    first = players[0][1].times.rates
    for fmt, player in players:
        results.append(result(fmt, player, [r / f if f else 0.0 for r, f in zip(player.times.rates, first)]))
        log(f"{fmt} / {results[-1].backend}: {rates(results[-1])}")
    return results


def ratios(xs: list[float] | None) -> str:
    """Per-round ratios as their median and spread (\"-\" without any)."""
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f}x ({min(xs):.3f}-{max(xs):.3f})"


def render(results: list[DecodeResult], num_seqs: int, bandwidth: float) -> str:
    by = {(r.kv_format, r.backend, r.graphs): r for r in results}
    interleaved = any(r.vs_first is not None for r in results)
    rows = []
    for r in results:
        native = by.get(("native", r.backend, r.graphs))
        reference = by.get((r.kv_format, "torch", False))
        limit = num_seqs * bandwidth / (r.weight_bytes + r.kv_bytes_per_step)
        eager = by.get((r.kv_format, r.backend, False)) if r.graphs else None
        graphs = "-" if r.graph_steps is None else f"{r.graph_steps:.0%} of steps"
        if eager is not None:
            graphs += f", {r.median / eager.median:.2f}x eager"
        rows.append([r.kv_format, r.backend, graphs, f"{r.kv_bytes_per_step / 2**20:,.0f}",
                     f"{r.median:.2f}", f"{min(r.tok_s):.2f}-{max(r.tok_s):.2f}", f"{r.step_ms:.2f}",
                     "-" if r.products_ms is None else f"{r.products_ms:.2f}",
                     "-" if r.attention_ms is None else f"{r.attention_ms:.2f}",
                     "-" if r.rest_ms is None else f"{r.rest_ms:.2f}",
                     f"{r.median / native.median:.2f}x" if native else "-",
                     f"{r.median / reference.median:.2f}x" if reference and reference is not r else "-",
                     f"{limit:.2f}", f"{r.median / limit:.0%}"] + ([ratios(r.vs_first)] if interleaved else []))
    return table(["format", "attention", "CUDA graphs", "KV MiB/step", "tok/s (median)", "spread", "step ms", "products ms",
                  "attend ms", "rest ms", "vs native",
                  "vs torch path", "limit tok/s", "of limit"] + (["vs first row, per round"] if interleaved else []),
                 rows)


def run_bench(args: argparse.Namespace) -> int:
    log = stderr_log("kv-decode")
    options = engine_options(args)
    device = resolve_device(options.get("device", "auto"))
    if args.graphs != "off" and device.type != "cuda":
        raise ValueError(f"--graphs {args.graphs}: CUDA graphs need a CUDA device, this run is on {device}")
    if args.random_model:
        if args.model or args.text:
            raise ValueError("--random-model times a model of a shape: give it without --model and --text")
        if args.threads:
            torch.set_num_threads(args.threads)
        loaded = random_model(args.random_model)
        text_ids = random_token_ids(args.context + 64 * args.seqs, loaded.config.vocab_size)
    else:
        loaded, text_ids = load_text_model(args.model, args.text, args.threads, "kv-decode")
    bandwidth = read_bandwidth(device=device)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s on {device}")
    kv_cache_gb = options.pop("kv_cache_memory_gb")     # every engine's pool, given to run on its own
    graphs = {"off": (False,), "on": (True,), "both": (False, True)}[args.graphs]
    results = run(loaded, text_ids, args.format or list(DEFAULT_FORMATS), args.backend or list(DEFAULT_BACKENDS),
                  args.seqs, args.context, args.steps, args.repeats, kv_cache_gb, log, options, args.interleave,
                  graphs)
    bandwidth = max(bandwidth, read_bandwidth(device=device))  # measured again after the runs: the box may have warmed
    w = results[0].weight_bytes if results else 0
    weights = results[0].weight_format if results else "-"
    print(f"decode, {args.seqs} requests x {args.context} context tokens, {args.steps} steps, median of "
          f"{args.repeats}{' (in rounds)' if args.interleave else ''}; {loaded.source}, weights {weights} ({w / 2**20:,.0f} MiB read per step), "
          f"{torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s on {device} (float32 sum over "
          f"1 GiB); "
          f"a step = products (every layer's and the LM head's) + attend (the backend's calls) + rest (norms' and "
          f"RoPE's remains, KV writes, per-layer Python, scheduling, sampling)")
    print(render(results, args.seqs, bandwidth))
    rows = result_rows(results)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "seqs": args.seqs, "context": args.context, "steps": args.steps, "bandwidth": bandwidth,
            "results": rows}, indent=2))
    if args.plot:      # plots needs matplotlib (the bench extra): imported only when asked for
        from kvserve.bench.plots import plot_step_parts
        write_plot(args.plot, lambda path: plot_step_parts(rows, path))
    return 0


def result_rows(results: list[DecodeResult]) -> list[dict[str, Any]]:
    """Each result with its derived figures: what ``--json`` writes and ``--plot`` draws."""
    return [asdict(r) | {"median": r.median, "rest_ms": r.rest_ms} for r in results]


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
    d.add_argument("--interleave", action="store_true",
                   help="play the repeats in rounds, every configuration once a round (all engines held at once: "
                        "configurations x --kv-cache-gb), and give each row's tok/s over the first row's per round")
    d.add_argument("--text", default=None, help="prompt text (default: the shipped botchan.txt)")
    d.add_argument("--random-model", choices=sorted(SHAPES), default=None,
                   help="time a model of this shape with random weights (no file; random prompt ids) instead of --model")
    d.add_argument("--graphs", choices=("off", "on", "both"), default="off",
                   help="decode steps replayed from CUDA graphs (--cuda-graphs): off, on, or both (each configuration "
                        "eager and with graphs, side by side; CUDA only)")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    add_engine_args(d, ("kv_cache_memory_gb", "weight_format"))
    d.set_defaults(run=run_bench)
