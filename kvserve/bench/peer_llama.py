"""The llama.cpp side of ``kvserve bench peer`` (peer.py): the rows both sides run, llama.cpp's
command lines, running them, and parsing their output (``llama-bench -o jsonl``,
``llama-batched-bench --output-format jsonl`` or its Markdown table)."""

from __future__ import annotations

import json
import shlex
import signal
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ROW_KINDS = ("decode", "depth", "batched", "prefill")
DECODE_STEPS = 128            # llama-bench -n 128
DEPTH_STEPS = 32              # llama-bench -n 32 -d D
DEPTH_HEADROOM = 64           # tokens of the context left free at the deepest depth
BATCH_PROMPT_TOKENS = 64      # llama-batched-bench -npp 64
BATCH_DECODE_STEPS = 128      # llama-batched-bench -ntg 128
PREFILL_TOKENS = 512          # llama-bench -p 512
LLAMA_TIMEOUT_S = 1800.0

class LlamaError(RuntimeError):
    """A llama.cpp run failed, timed out or printed no result for its row."""


@dataclass(frozen=True)
class Row:
    """``num_seqs`` sequences of ``num_prompt_tokens`` each, then ``num_decode_steps`` decode passes."""

    kind: str
    num_seqs: int
    num_prompt_tokens: int
    num_decode_steps: int

    def __post_init__(self) -> None:
        if self.kind not in ROW_KINDS:
            raise ValueError(f"unknown row {self.kind!r}; rows: {', '.join(ROW_KINDS)}")

    @property
    def is_decode(self) -> bool:
        return self.kind in ("decode", "depth")

    @property
    def depth(self) -> int:
        return self.num_prompt_tokens if self.kind == "depth" else 0

    @property
    def num_counted_tokens(self) -> int:
        """The numerator of both sides' tok/s."""
        if self.is_decode:
            return self.num_decode_steps
        return self.num_seqs * (self.num_prompt_tokens + self.num_decode_steps)

    @property
    def label(self) -> str:
        return {"decode": "decode, batch 1", "depth": f"decode, batch 1, depth {self.depth}",
                "batched": f"batch {self.num_seqs}, {self.num_prompt_tokens}+{self.num_decode_steps}, whole run",
                "prefill": f"prefill {self.num_prompt_tokens}"}[self.kind]

    @property
    def llama_test(self) -> str:
        """llama.cpp's name for the figure."""
        if self.kind == "batched":
            return f"S t/s, npl {self.num_seqs}"
        if self.kind == "prefill":
            return f"pp{self.num_prompt_tokens}"
        return f"tg{self.num_decode_steps}" + (f" @ d{self.depth}" if self.depth else "")


def make_rows(kinds: Sequence[str], depths: Sequence[int], batches: Sequence[int], max_model_len: int) -> list[Row]:
    """The rows of ``kinds`` in table order; depths above ``max_model_len - DEPTH_HEADROOM`` are clipped to it."""
    unknown = sorted(set(kinds) - set(ROW_KINDS))
    if unknown:
        raise ValueError(f"unknown rows {', '.join(unknown)}; rows: {', '.join(ROW_KINDS)}")
    deepest = max_model_len - DEPTH_HEADROOM
    rows = {"decode": [Row("decode", 1, 1, DECODE_STEPS)],
            "depth": [Row("depth", 1, d, DEPTH_STEPS) for d in dict.fromkeys(min(d, deepest) for d in depths)],
            "batched": [Row("batched", b, BATCH_PROMPT_TOKENS, BATCH_DECODE_STEPS) for b in batches],
            "prefill": [Row("prefill", 1, PREFILL_TOKENS, 0)]}
    return [r for kind in ROW_KINDS if kind in kinds for r in rows[kind]]


# -- llama.cpp: command lines, running, parsing ------------------------------------------------

class LlamaPaths(NamedTuple):
    """llama.cpp's binaries; None: not given (its rows go without a peer figure)."""

    bench: Path | None
    batched_bench: Path | None

    def binary(self, row: Row) -> Path | None:
        return self.batched_bench if row.kind == "batched" else self.bench


def llama_command(binary: Path, row: Row, model: Path, threads: int, repeats: int,
                  extra: Sequence[str] = ()) -> list[str]:
    """The command line for ``row``: llama-bench with ``-r repeats`` (JSON lines), or one run of
    llama-batched-bench (JSON lines; it has no repetitions); ``extra``: more of llama.cpp's flags
    (``--llama-args``, e.g. ``-fa 1``), given to both binaries."""
    head = [str(binary), "-m", str(model), "-t", str(threads), *extra]
    if row.kind == "batched":
        return head + ["-npp", str(row.num_prompt_tokens), "-ntg", str(row.num_decode_steps),
                       "-npl", str(row.num_seqs), "--output-format", "jsonl"]
    if row.kind == "prefill":
        counts = ["-p", str(row.num_prompt_tokens), "-n", "0"]
    else:
        counts = ["-p", "0", "-n", str(row.num_decode_steps)] + (["-d", str(row.depth)] if row.depth else [])
    return head + ["-r", str(repeats)] + counts + ["-o", "jsonl"]


def run_llama(command: Sequence[str], timeout_s: float = LLAMA_TIMEOUT_S) -> str:
    """``command``'s stdout; LlamaError naming the command and the tail of its stderr when it
    cannot start, times out, or exits with an error or a signal."""
    line = shlex.join(command)
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s, check=False)
    except OSError as e:
        raise LlamaError(f"cannot run {line}: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise LlamaError(f"{line} ran past {timeout_s:.0f} s") from e
    if done.returncode == 0:
        return done.stdout
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        why = f"killed by {sig}" + (" (llama.cpp's AMX build does this here: build without AMX)"
                                    if sig == "SIGSEGV" else "")
    else:
        why = f"exit status {done.returncode}"
    tail = "\n".join(done.stderr.strip().splitlines()[-15:]) or "(empty)"
    raise LlamaError(f"{line} failed: {why}; stderr ends:\n{tail}")


class BenchRecord(NamedTuple):
    """One test of llama-bench's JSON output (t/s over its repetitions)."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    stddev_ts: float
    samples_ts: tuple[float, ...]
    build_commit: str
    model_size: int             # bytes of the model's tensors


class BatchedRecord(NamedTuple):
    """One line of llama-batched-bench: ``speed`` is its S t/s, all tokens over ``t_s``."""

    pp: int
    tg: int
    pl: int
    t_s: float
    speed: float


class LlamaFigure(NamedTuple):
    mean_tok_s: float
    sd_tok_s: float
    num_runs: int
    samples_tok_s: tuple[float, ...]
    weight_nbytes: int | None = None    # llama-bench's model size (the bytes a decode pass reads)


def _json_objects(text: str) -> list[dict[str, Any]]:
    """The objects of a JSON array (``-o json``) or of JSON lines (``-o jsonl``) in ``text``;
    other lines (logs) are skipped."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            return [o for o in json.loads(stripped) if isinstance(o, dict)]
        except json.JSONDecodeError:
            pass
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def parse_llama_bench(text: str) -> list[BenchRecord]:
    """llama-bench's tests from its ``-o json`` or ``-o jsonl`` output."""
    return [BenchRecord(int(o["n_prompt"]), int(o["n_gen"]), int(o.get("n_depth", 0)), float(o["avg_ts"]),
                        float(o["stddev_ts"]), tuple(float(x) for x in o.get("samples_ts", ())),
                        str(o.get("build_commit", "")), int(o.get("model_size", 0)))
            for o in _json_objects(text) if {"n_prompt", "n_gen", "avg_ts", "stddev_ts"} <= o.keys()]


def parse_batched_bench(text: str) -> list[BatchedRecord]:
    """llama-batched-bench's lines from its ``--output-format jsonl`` output, else from its
    Markdown table (``| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |``)."""
    records = [BatchedRecord(int(o["pp"]), int(o["tg"]), int(o["pl"]), float(o["t"]), float(o["speed"]))
               for o in _json_objects(text) if {"pp", "tg", "pl", "t", "speed"} <= o.keys()]
    if records:
        return records
    columns: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S t/s" in cells and "PP" in cells:
            columns = cells
        elif columns and len(cells) == len(columns) and cells[0].isdigit():
            at = dict(zip(columns, cells))
            records.append(BatchedRecord(int(at["PP"]), int(at["TG"]), int(at["B"]), float(at["T s"]),
                                         float(at["S t/s"])))
    return records


def bench_figure(records: Sequence[BenchRecord], row: Row) -> LlamaFigure:
    """``row``'s figure from llama-bench's tests (its mean ± sd as printed)."""
    want = (row.num_prompt_tokens, 0, 0) if row.kind == "prefill" else (0, row.num_decode_steps, row.depth)
    for r in records:
        if (r.n_prompt, r.n_gen, r.n_depth) == want:
            return LlamaFigure(r.avg_ts, r.stddev_ts, len(r.samples_ts), r.samples_ts, r.model_size or None)
    raise LlamaError(f"llama-bench printed no {row.llama_test} test (found: "
                     f"{', '.join(f'p{r.n_prompt} n{r.n_gen} d{r.n_depth}' for r in records) or 'none'})")


def batched_figure(runs: Sequence[Sequence[BatchedRecord]], row: Row) -> LlamaFigure:
    """``row``'s figure over runs of llama-batched-bench: the mean ± sd (n - 1, as llama-bench's)
    of S t/s."""
    speeds = []
    for records in runs:
        match = [r.speed for r in records
                 if (r.pp, r.tg, r.pl) == (row.num_prompt_tokens, row.num_decode_steps, row.num_seqs)]
        if not match:
            raise LlamaError(f"llama-batched-bench printed no line for npp {row.num_prompt_tokens}, ntg "
                             f"{row.num_decode_steps}, npl {row.num_seqs} (it skips a test its context cannot hold)")
        speeds.append(match[0])
    return LlamaFigure(statistics.fmean(speeds), statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                       len(speeds), tuple(speeds))
