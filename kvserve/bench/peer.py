"""``kvserve bench peer``: kvserve against llama.cpp on the same GGUF file, token counts and threads.

Each row runs llama.cpp (``llama-bench`` or ``llama-batched-bench``, a subprocess) and then
kvserve (``torch.set_num_threads(threads)``, ``-t threads`` for llama.cpp), so both meet the same
machine state. A *decode pass* is one forward pass of one token per sequence. What each side
measures, in tokens per second:

- ``decode``, batch 1. llama.cpp ``llama-bench -p 0 -n 128`` (tg128): 128 decode passes from an
  empty context (the first feeds BOS), timed together, no sampling; t/s = 128 / time. kvserve:
  one request with a 1-token prompt (BOS) and 129 greedy tokens, eos ignored; the step that
  prefills the prompt (and gives token 1) is not timed, the 128 decode steps after it are:
  tok/s = decode tokens / the sum of those steps' wall times.
- ``depth``, batch 1 at depth D. llama.cpp ``llama-bench -p 0 -n 32 -d D``: D random tokens are
  prefilled (not timed), then 32 decode passes are timed. kvserve: a prompt of the text's first
  D tokens, then 32 decode steps timed as above. D is clipped to the model's context less
  ``DEPTH_HEADROOM`` on both sides: SmolLM2's context is 8192, kvserve refuses positions past it
  (llama.cpp runs them), so ``--depths 4096,8192`` measures 4096 and 8128. kvserve's engine for
  these rows caches prefixes, so a repeat's prefill is a cache hit; llama-bench likewise
  restores the depth's state between its repetitions.
- ``batched``, B sequences. llama.cpp ``llama-batched-bench -npp 64 -ntg 128 -npl B``, column
  ``S t/s``: B random 64-token prompts prefilled, then 128 decode passes of B tokens; speed =
  B x (64 + 128) / (prefill time + decode time). kvserve: B requests with distinct 64-token
  prompts submitted at once, 129 greedy tokens each (eos ignored, prefix caching off), so each
  sequence runs the same 64 prompt tokens and 128 decode passes (the 129th token comes from
  the last pass's logits, which llama.cpp computes too); tok/s = B x (64 + 128) / the wall time
  from submission to the last token. llama-batched-bench has no repetitions: it runs once per
  repeat, alternating with kvserve.
- ``prefill``. llama.cpp ``llama-bench -p 512 -n 0`` (pp512): one 512-token batch, t/s = 512 /
  time. kvserve: a 512-token prompt, max_tokens 1, prefix caching off: 512 / the wall time from
  submission to the first token.

kvserve runs one warm-up per row (not counted), as llama.cpp does; its figure is the median of
``--repeats`` runs with the spread (min-max), llama.cpp's is the mean ± sd it prints (over its
repetitions). Decode rows set both against the memory-bandwidth limit: a decode pass reads
every weight once, so limit tok/s = read bandwidth / weight bytes (kvserve's
``Decoder.weight_nbytes``, llama.cpp's model size: the same bytes for a GGUF read in place),
the bandwidth measured in the same run (``kv_decode.read_bandwidth``, the larger of before and
after the rows); the KV read at depth comes on top.

llama.cpp keeps its defaults otherwise: f16 KV (kvserve's default KV is float32), batch 2048 /
ubatch 512, random token ids, flash attention auto, unless ``--llama-args`` gives llama-bench
other flags: repeated, each variant runs and a row takes the fastest (on this CPU flash
attention is faster at short contexts and 2.5x slower at depth 4096, so the runs recorded in
docs/benchmarks.md give ``--llama-args '-fa 0' --llama-args '-fa 1'``). The binaries used here are built
from the llama-cpp-python 0.3.36 sdist's vendored llama.cpp with ``-DGGML_NATIVE=ON`` and AMX
off: a build with AMX dies of SIGSEGV in this sandbox as soon as it runs a prompt batch (the
kernel grants no AMX tile permission). Its threads spin at barriers, so with ``-t`` equal to the
cores it is very sensitive to other work on the machine: run this on a quiet box.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvserve.bench.common import table
from kvserve.bench.peer_llama import (
    DEPTH_HEADROOM,
    ROW_KINDS,
    LlamaError,
    LlamaFigure,
    LlamaPaths,
    Row,
    batched_figure,
    bench_figure,
    llama_command,
    make_rows,
    parse_batched_bench,
    parse_llama_bench,
    run_llama,
)
from kvserve.llm import LLM
from kvserve.model.loader import resolve_model_path
from kvserve.options import add_engine_args
from kvserve.sampling_params import SamplingParams

# engine flags that mean something here (--device and --dtype come with every bench; each
# row sets prefix caching itself)
PEER_ENGINE_OPTIONS = ("max_model_len", "weight_format", "linear_backend", "attention_backend", "kv_format",
                       "kv_cache_memory_gb", "num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
                       "enable_chunked_prefill")


# -- kvserve: the timed runs -------------------------------------------------------------------

class Timed(NamedTuple):
    num_tokens: int     # the tokens the figure counts
    seconds: float
    num_steps: int      # engine steps in ``seconds``

    @property
    def tok_s(self) -> float:
        return self.num_tokens / self.seconds


def time_decode(llm: LLM, prompt: list[int], num_steps: int,
                clock: Callable[[], float] = time.perf_counter) -> Timed:
    """One request decoding ``num_steps`` tokens after its prompt: only the decode steps are
    timed (the steps that prefill, up to the one giving the first token, are not)."""
    engine = llm.engine
    if engine.has_unfinished:
        raise ValueError("time_decode needs an idle engine")
    engine.add_request(prompt, SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True))
    seconds, steps = 0.0, 0
    while engine.has_unfinished:
        t = clock()
        outputs = engine.step()
        dt = clock() - t
        if outputs and len(outputs[0].token_ids) > 1:     # the request had its first token before this step
            seconds += dt
            steps += 1
    if steps != num_steps:
        raise ValueError(f"{steps} decode steps instead of {num_steps}: the engine's max_model_len "
                         f"{engine.max_model_len} cannot hold {len(prompt)} + {num_steps + 1} tokens")
    return Timed(steps, seconds, steps)


def time_batch(llm: LLM, prompts: Sequence[list[int]], num_decode_steps: int,
               clock: Callable[[], float] = time.perf_counter) -> Timed:
    """All ``prompts`` submitted at once, each then running ``num_decode_steps`` decode passes
    (``num_decode_steps + 1`` tokens): wall time from submission to the last token, counting every
    prompt token and every decode pass (llama-batched-bench's S t/s; with no decode steps, a prefill)."""
    engine = llm.engine
    if engine.has_unfinished:
        raise ValueError("time_batch needs an idle engine")
    params = SamplingParams(max_tokens=num_decode_steps + 1, temperature=0.0, ignore_eos=True)
    steps_before = engine.num_steps
    t = clock()
    for p in prompts:
        engine.add_request(p, params)
    lengths: list[int] = []
    while engine.has_unfinished:
        lengths += [len(o.token_ids) for o in engine.step() if o.finished]
    seconds = clock() - t
    if lengths != [num_decode_steps + 1] * len(prompts):
        raise ValueError(f"requests finished with {lengths} tokens, not {num_decode_steps + 1} each")
    return Timed(sum(len(p) + num_decode_steps for p in prompts), seconds, engine.num_steps - steps_before)


def row_prompts(row: Row, text_ids: list[int], bos_id: int | None) -> list[list[int]]:
    """kvserve's prompts: BOS (else the text's first token) for ``decode``; the text's first
    tokens for ``depth``; distinct slices of the text (no shared block) for ``batched`` and ``prefill``."""
    if row.kind == "decode":
        return [[text_ids[0] if bos_id is None else bos_id]]
    if row.kind == "depth":
        return [text_ids[:row.num_prompt_tokens]]
    need = (row.num_seqs + 1) * row.num_prompt_tokens
    if len(text_ids) < need:
        raise ValueError(f"the text has {len(text_ids)} tokens, {row.label} needs {need}")
    # slices after the first prompt's worth, so a batch never starts where the depth rows do
    return [text_ids[(i + 1) * row.num_prompt_tokens:(i + 2) * row.num_prompt_tokens] for i in range(row.num_seqs)]


def time_row(llm: LLM, row: Row, prompts: list[list[int]]) -> Timed:
    if row.is_decode:
        return time_decode(llm, prompts[0], row.num_decode_steps)
    return time_batch(llm, prompts, row.num_decode_steps)


# -- a row on both sides, the table ------------------------------------------------------------

@dataclass(frozen=True)
class RowResult:
    row: Row
    kvserve: tuple[Timed, ...]           # one per repeat
    llama: LlamaFigure | None            # None: no llama.cpp binary for this row
    llama_commands: tuple[str, ...] = ()

    @property
    def kvserve_tok_s(self) -> float:
        return statistics.median(t.tok_s for t in self.kvserve)

    @property
    def ratio(self) -> float | None:
        """kvserve / llama.cpp."""
        return None if self.llama is None else self.kvserve_tok_s / self.llama.mean_tok_s


def run_row(llm: LLM, row: Row, prompts: list[list[int]], paths: LlamaPaths, model: Path, threads: int,
            repeats: int, run: Callable[[Sequence[str]], str] = run_llama,
            variants: Sequence[Sequence[str]] = ((),)) -> RowResult:
    """One warm-up of kvserve, then llama.cpp and kvserve's ``repeats``: llama-bench once with
    ``-r repeats`` per variant of its flags (``--llama-args``; the fastest is the row's figure)
    before kvserve's runs; llama-batched-bench (its own defaults) once before each kvserve run."""
    time_row(llm, row, prompts)
    binary = paths.binary(row)
    if binary is None:
        return RowResult(row, tuple(time_row(llm, row, prompts) for _ in range(repeats)), None)
    if row.kind == "batched":
        command = llama_command(binary, row, model, threads, repeats)
        runs, timed = [], []
        for _ in range(repeats):
            runs.append(parse_batched_bench(run(command)))
            timed.append(time_row(llm, row, prompts))
        return RowResult(row, tuple(timed), batched_figure(runs, row), (shlex.join(command),) * repeats)
    best: tuple[LlamaFigure, list[str]] | None = None
    for extra in variants:
        command = llama_command(binary, row, model, threads, repeats, extra)
        figure = bench_figure(parse_llama_bench(run(command)), row)
        if best is None or figure.mean_tok_s > best[0].mean_tok_s:
            best = (figure, command)
    assert best is not None
    return RowResult(row, tuple(time_row(llm, row, prompts) for _ in range(repeats)), best[0],
                     (shlex.join(best[1]),))


def render(results: Sequence[RowResult], bandwidth: float, weight_nbytes: int) -> str:
    """The Markdown table. Decode rows' limit: ``bandwidth`` (bytes / s) over the weight bytes a
    decode pass reads, kvserve's ``weight_nbytes`` and llama.cpp's model size; the column gives
    both when they differ (``--weight-format native``: kvserve's float32 weights)."""
    rows = []
    for r in results:
        tok_s = [t.tok_s for t in r.kvserve]
        llama = r.llama
        cells = [r.row.label, r.row.llama_test,
                 "-" if llama is None else f"{llama.mean_tok_s:.2f} ± {llama.sd_tok_s:.2f} ({llama.num_runs})",
                 f"{r.kvserve_tok_s:.2f}", f"{min(tok_s):.2f}-{max(tok_s):.2f} ({len(tok_s)})",
                 "-" if r.ratio is None else f"{r.ratio:.2f}x"]
        if r.row.is_decode:
            limit = bandwidth / weight_nbytes
            peer_limit = bandwidth / (llama.weight_nbytes or weight_nbytes) if llama else limit
            cells += [f"{limit:.1f}" if round(peer_limit, 1) == round(limit, 1) else f"{limit:.1f} / {peer_limit:.1f}",
                      "-" if llama is None else f"{llama.mean_tok_s / peer_limit:.0%}", f"{r.kvserve_tok_s / limit:.0%}"]
        else:
            cells += ["-", "-", "-"]
        rows.append(cells)
    return table(["row", "llama.cpp test", "llama.cpp tok/s (mean ± sd, runs)", "kvserve tok/s (median)",
                  "kvserve spread (runs)", "kvserve / llama.cpp", "bandwidth limit tok/s", "llama.cpp of limit",
                  "kvserve of limit"], rows)


class Conditions(NamedTuple):
    model: str
    weight_format: str
    kv_format: str
    threads: int
    num_cores: int | None
    cpu: str
    date: str
    bandwidth: float            # bytes / s
    weight_nbytes: int
    llama_version: str | None   # None: llama.cpp not run

    def header(self) -> str:
        peer = (f"llama.cpp {self.llama_version} (KV f16, its defaults)" if self.llama_version
                else "llama.cpp not run")
        return (f"kvserve bench peer: {self.model}; kvserve weights {self.weight_format}, KV {self.kv_format}; "
                f"{peer}; {self.threads} threads (this machine has {self.num_cores or '?'} cores); CPU {self.cpu}; "
                f"{self.date}; read bandwidth {self.bandwidth / 1e9:.1f} GB/s, weights read per decode pass "
                f"{self.weight_nbytes / 2**20:.1f} MiB: limit {self.bandwidth / self.weight_nbytes:.1f} tok/s")


def cpu_model(cpuinfo: str) -> str:
    """The first ``model name`` of /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def parse_version(text: str) -> str | None:
    """``0.5.0-dev (build 1, commit 0c1e570)`` from a llama.cpp binary's ``--version`` output."""
    for line in text.splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return None


def llama_version(binary: Path) -> str | None:
    """What ``binary --version`` says (on stderr), None when it says nothing readable."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(done.stdout + "\n" + done.stderr)


def absent_line(paths: LlamaPaths, kinds: Sequence[str]) -> str | None:
    """The line saying which llama.cpp columns are absent and why (None: none are)."""
    single = [k for k in kinds if k != "batched"]
    parts = ([f"rows {', '.join(single)} need --llama-bench PATH"] if paths.bench is None and single else []) + \
        (["rows batched need --llama-batched-bench PATH"] if paths.batched_bench is None and "batched" in kinds else [])
    return "llama.cpp columns absent: " + "; ".join(parts) if parts else None


def gguf_path(model: str | None) -> Path:
    """The GGUF file ``model`` names; ValueError for anything else (llama.cpp reads the same file)."""
    try:
        path = resolve_model_path(model)
    except ValueError as e:
        raise ValueError(f"bench peer compares with llama.cpp on the same GGUF file: {e}") from e
    if path.is_dir():
        raise ValueError(f"bench peer compares with llama.cpp on the same GGUF file, and {str(path)!r} is a "
                         "Hugging Face directory: pass --model FILE.gguf")
    return path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def plot_rows(results: Sequence[RowResult], bandwidth: float, weight_nbytes: int) -> list[dict[str, Any]]:
    """What ``plots.plot_peer`` draws (and ``--json`` writes per row)."""
    return [{"label": r.row.label, "kind": r.row.kind, "llama_test": r.row.llama_test,
             "kvserve_tok_s": r.kvserve_tok_s, "kvserve_runs_tok_s": [t.tok_s for t in r.kvserve],
             "kvserve_steps": [t.num_steps for t in r.kvserve],
             "llama_tok_s": None if r.llama is None else r.llama.mean_tok_s,
             "llama_sd_tok_s": None if r.llama is None else r.llama.sd_tok_s,
             "llama_runs_tok_s": None if r.llama is None else list(r.llama.samples_tok_s),
             "llama_commands": list(r.llama_commands), "ratio": r.ratio,
             "limit_tok_s": bandwidth / weight_nbytes if r.row.is_decode else None,
             "llama_weight_nbytes": None if r.llama is None else r.llama.weight_nbytes} for r in results]


def _llama_paths(args: argparse.Namespace) -> LlamaPaths:
    paths = []
    for flag, given in (("--llama-bench", args.llama_bench), ("--llama-batched-bench", args.llama_batched_bench)):
        if given is not None and not Path(given).is_file():
            raise ValueError(f"{flag} {given}: no such file")
        paths.append(None if given is None else Path(given).resolve())
    return LlamaPaths(*paths)


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench import plots
    from kvserve.bench.common import find_text, stderr_log, write_plot
    from kvserve.bench.kv_decode import read_bandwidth
    from kvserve.model.loader import load_model
    from kvserve.options import engine_options

    log = stderr_log("peer")
    if args.threads < 1 or args.repeats < 1:
        raise ValueError("--threads and --repeats must be at least 1")
    model = gguf_path(args.model)
    paths = _llama_paths(args)
    kinds = [k.strip() for k in args.rows.split(",") if k.strip()]
    torch.set_num_threads(args.threads)
    loaded = load_model(str(model))
    if loaded.tokenizer is None:
        raise ValueError(f"bench peer needs a model with a tokenizer ({model} has none)")
    text_ids = loaded.tokenizer.encode(find_text(args.text))
    options = {k: v for k, v in engine_options(args).items() if k != "enable_prefix_caching"}
    cold = LLM(loaded=loaded, enable_prefix_caching=False, **options)
    # depth rows: a repeat's prompt is a prefix-cache hit (llama-bench restores the depth's state too)
    warm = LLM(loaded=loaded, enable_prefix_caching=True, **options) if "depth" in kinds else cold
    rows = make_rows(kinds, _ints(args.depths), _ints(args.batches), cold.engine.max_model_len)
    absent = absent_line(paths, kinds)
    if absent:
        log(absent)
    versions = [llama_version(p) for p in paths if p is not None]
    bandwidth = read_bandwidth()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {len(rows)} rows, {args.repeats} repeats each")
    results = []
    for row in rows:
        log(f"{row.label}: llama.cpp {row.llama_test} and kvserve ...")
        try:
            result = run_row(warm if row.kind == "depth" else cold, row,
                             row_prompts(row, text_ids, loaded.tokenizer.bos_token_id), paths, model, args.threads,
                             args.repeats, variants=[shlex.split(v) for v in args.llama_args or [""]])
        except LlamaError as e:
            print(f"kvserve bench peer: {e}", file=sys.stderr)
            return 1
        peer = "-" if result.llama is None else f"{result.llama.mean_tok_s:.2f}"
        log(f"{row.label}: kvserve {result.kvserve_tok_s:.2f} tok/s, llama.cpp {peer}")
        results.append(result)
    bandwidth = max(bandwidth, read_bandwidth())      # again after the runs: the box may have quietened
    engine = cold.engine
    cpuinfo = Path("/proc/cpuinfo")
    conditions = Conditions(model.name, engine.weight_format, f"{engine.kv_format.spec} ({engine.dtype})",
                            args.threads, os.cpu_count(), cpu_model(cpuinfo.read_text() if cpuinfo.exists() else ""),
                            time.strftime("%Y-%m-%d %H:%M"), bandwidth, engine.model.weight_nbytes,
                            next((v for v in versions if v), None))
    print(conditions.header())
    print(render(results, bandwidth, engine.model.weight_nbytes))
    if absent:
        print(absent)
    numbers = plot_rows(results, bandwidth, engine.model.weight_nbytes)
    write_plot(args.plot, lambda path: plots.plot_peer(numbers, path))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "peer", "conditions": conditions._asdict(),
                                               "rows": numbers}, indent=2))
    return 0


def add_peer_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = bsub.add_parser("peer", parents=[common],
                        help="kvserve vs llama.cpp on the same GGUF: decode, depth, batched and prefill tok/s")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench (without it: kvserve alone for decode, depth and prefill)")
    p.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-batched-bench (without it: kvserve alone for the batched rows)")
    p.add_argument("--llama-args", action="append", default=None, metavar="ARGS",
                   help="more flags for llama-bench, e.g. '-fa 0'; repeat it to try several (each row takes the "
                        "fastest: llama.cpp's flash attention wins at short contexts and loses at depth on CPUs)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads for kvserve, -t for llama.cpp (default 2: the project's box has 2 cores)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and row (llama-bench -r)")
    p.add_argument("--rows", default=",".join(ROW_KINDS), help=f"rows to run, of {', '.join(ROW_KINDS)}")
    p.add_argument("--depths", default="4096,8192",
                   help=f"context depths of the depth rows (clipped to the model's context - {DEPTH_HEADROOM})")
    p.add_argument("--batches", default="8,16", help="sequences per batched row")
    p.add_argument("--text", default=None, help="prompt text (default: the botchan.txt shipped with kvserve)")
    add_engine_args(p, PEER_ENGINE_OPTIONS)
    p.set_defaults(run=run_bench)
