"""``kvserve eval-weights``: each weight format's quality against the native (float) weights.

Every format gets its own engine (uncompressed KV cache) and the workload of ``kvserve eval``
(``harness.Workload``): perplexity by sliding windows over the start of the text, and greedy
chat outputs compared token by token with native's. ``native`` always runs, first: it is the
reference of every perplexity delta and of agreement. A format's resident weight bytes
(``Decoder.weight_nbytes``) are set against native's and the model file's size.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.bench.common import table
from kvserve.eval.agreement import agreement
from kvserve.eval.backends import KVServeBackend
from kvserve.eval.harness import EvalSettings, Log, Workload, evaluate, stderr_log
from kvserve.eval.perplexity import PerplexityResult, describe_layout
from kvserve.kv.prefix import common_prefix_len
from kvserve.model.formats.spec import parse_weight_format
from kvserve.model.loader import LoadedModel

NATIVE = "native"
# (format, its perplexity may be at most this many percent above native's)
PERPLEXITY_GOALS = (("gguf", 0.5), ("int8", 0.5), ("int4", 3.0))


def weight_settings(ppl_tokens: int = 2048, window: int = 1024, stride: int = 512, chunk: int = 64,
                    num_prompts: int = 8, agree_tokens: int = 32, ppl_layout: str = "sliding") -> EvalSettings:
    """``kvserve eval``'s settings for the two tasks run here (no passkey cases are built)."""
    return EvalSettings(ppl_tokens=ppl_tokens, window=window, stride=stride, ppl_layout=ppl_layout, chunk=chunk,
                        num_prompts=num_prompts, agree_tokens=agree_tokens, passkey_lengths=(), tasks=("ppl", "agree"))


def settings_json(settings: EvalSettings) -> dict[str, int | str]:
    return {name: getattr(settings, name) for name in ("ppl_tokens", "window", "stride", "ppl_layout", "chunk",
                                                         "num_prompts", "agree_tokens")}


@dataclass(frozen=True)
class WeightResult:
    spec: str                     # as asked (auto, int4-g32, ...)
    name: str                     # the format the engine resolved it to (auto -> gguf, int4-g32 -> int4)
    weight_nbytes: int            # resident weights a decode step reads
    ppl: PerplexityResult
    agreement: float              # harness.agreement vs native's greedy outputs
    prefix_lens: tuple[int, ...]  # per chat prompt: tokens equal to native's before the first difference
    agree_tokens: int             # greedy tokens per prompt
    seconds: float

    @property
    def label(self) -> str:
        return self.name if self.spec == self.name else f"{self.spec} ({self.name})"

    @property
    def mean_divergence(self) -> float:
        """Mean position of the first token unlike native's (``agree_tokens`` where none is)."""
        return sum(self.prefix_lens) / len(self.prefix_lens)

    @property
    def num_diverged(self) -> int:
        return sum(n < self.agree_tokens for n in self.prefix_lens)


def with_native_first(specs: Sequence[str]) -> list[str]:
    return [NATIVE] + [s for s in specs if s != NATIVE]


def evaluate_formats(loaded: LoadedModel, work: Workload, settings: EvalSettings, specs: Sequence[str],
                     engine_options: dict[str, Any], log: Log = stderr_log) -> list[WeightResult]:
    """One row per format of ``specs``, native first (added when absent); each engine is
    dropped before the next is built, so one model's weights are resident at a time."""
    specs = with_native_first(specs)
    for spec in specs:
        parse_weight_format(spec)               # a typo fails now, not after native's run
    results: list[WeightResult] = []
    reference: list[list[int]] = []
    for spec in specs:
        backend = KVServeBackend(loaded, "native", settings.chunk, name=spec, weight_format=spec, **engine_options)
        engine = backend.llm.engine
        name, nbytes = engine.weight_format, engine.model.weight_nbytes
        log(f"{spec}: weight format {name}, {nbytes / 2**20:.1f} MiB of weights")
        measured, outputs = evaluate(backend, "kvserve", work, settings, None, settings.tasks, log)
        assert measured.ppl is not None and outputs is not None
        reference = reference or outputs        # native's, computed first
        share = agreement(outputs, reference, settings.agree_tokens)
        prefix_lens = tuple(common_prefix_len(o, r) for o, r in zip(outputs, reference))
        results.append(WeightResult(spec, name, nbytes, measured.ppl, share, prefix_lens, settings.agree_tokens,
                                    measured.seconds))
        log(f"{spec}: greedy agreement {share:.3f}, first divergence at token {results[-1].mean_divergence:.1f} "
            f"on average")
        del backend, engine
        gc.collect()
    return results


def file_nbytes(source: str) -> int | None:
    """Size of the model file (a GGUF), None for a directory or a model not read from a file."""
    path = Path(source)
    return path.stat().st_size if path.is_file() else None


# ---- report ------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x:+.2f}%"


def delta_pct(r: WeightResult, base: WeightResult) -> float:
    return 100 * (r.ppl.perplexity / base.ppl.perplexity - 1)


def _native(results: Sequence[WeightResult]) -> WeightResult:
    return next(r for r in results if r.name == NATIVE)


def render_table(results: Sequence[WeightResult], source_nbytes: int | None) -> str:
    native = _native(results)
    agree_tokens = native.agree_tokens
    headers = ["format", "weights (MiB)", "vs native", "vs file", "perplexity", "Δ vs native", "agreement",
               f"first divergence (of {agree_tokens})", "diverged", "time (s)"]
    rows = [[r.label, f"{r.weight_nbytes / 2**20:.1f}", f"{native.weight_nbytes / r.weight_nbytes:.2f}x",
             "—" if source_nbytes is None else f"{r.weight_nbytes / source_nbytes:.2f}x",
             f"{r.ppl.perplexity:.3f}", _pct(delta_pct(r, native)), f"{r.agreement:.3f}",
             f"{r.mean_divergence:.1f}", f"{r.num_diverged}/{len(r.prefix_lens)}", f"{r.seconds:.0f}"]
            for r in results]
    return table(headers, rows)


def _by_name(results: Sequence[WeightResult]) -> dict[str, WeightResult]:
    by: dict[str, WeightResult] = {}
    for r in results:
        by.setdefault(r.name, r)        # the first row of a format (auto and gguf may both be gguf)
    return by


def goal_lines(results: Sequence[WeightResult]) -> list[str]:
    """Each perplexity goal, 'met' or 'MISSED' with its numbers (skipped when its row is absent)."""
    by = _by_name(results)
    native = _native(results)
    lines = []
    for name, limit_pct in PERPLEXITY_GOALS:
        r = by.get(name)
        if r is None:
            continue
        d = delta_pct(r, native)
        lines.append(f"{name} perplexity within {limit_pct:g}% of native: {_pct(d)} ({r.ppl.perplexity:.3f} vs "
                     f"{native.ppl.perplexity:.3f}), greedy agreement {r.agreement:.3f}: "
                     f"{'met' if d <= limit_pct else 'MISSED'}")
    return lines


def outlier_lines(results: Sequence[WeightResult]) -> list[str]:
    """What outlier channels buy: each +outN row against its format without them (no goal)."""
    by = _by_name(results)
    native = _native(results)
    lines = []
    for r in by.values():
        fmt = parse_weight_format(r.name)
        base = by.get(replace(fmt, outliers=0).name) if fmt.outliers else None
        if base is None:
            continue
        lines.append(f"{r.name} vs {base.name}: perplexity {r.ppl.perplexity:.3f} vs {base.ppl.perplexity:.3f} "
                     f"({_pct(delta_pct(r, base))}; vs native {_pct(delta_pct(r, native))} vs "
                     f"{_pct(delta_pct(base, native))}), greedy agreement {r.agreement:.3f} vs {base.agreement:.3f}")
    return lines


def to_json(results: Sequence[WeightResult]) -> list[dict[str, Any]]:
    native = _native(results)
    return [{"spec": r.spec, "name": r.name, "weight_nbytes": r.weight_nbytes, "perplexity": r.ppl.perplexity,
             "nll_sum": r.ppl.nll_sum, "num_scored": r.ppl.num_scored, "delta_pct": delta_pct(r, native),
             "agreement": r.agreement, "prefix_lens": list(r.prefix_lens), "agree_tokens": r.agree_tokens,
             "mean_divergence": r.mean_divergence, "seconds": r.seconds} for r in results]


def header_lines(source: str, source_nbytes: int | None, device: str, dtype: str, text_label: str,
                 settings: EvalSettings) -> list[str]:
    s = settings
    size = "" if source_nbytes is None else f" ({source_nbytes / 2**20:.1f} MiB)"
    engine = (f"kvserve eval-weights: {source}{size}, device {device}, compute dtype {dtype}, KV cache "
              f"uncompressed, prompts fed in chunks of {s.chunk} tokens")
    windows = describe_layout(s.ppl_layout, s.window, s.stride)
    tasks = (f"perplexity: first {s.ppl_tokens} tokens of {text_label}, {windows}; "
             f"agreement: {s.num_prompts} chat prompts x {s.agree_tokens} greedy tokens vs native's (share of "
             f"tokens before the first difference; first divergence: its mean position)")
    return [engine, tasks]


def run(model: str | None, text: str, text_label: str, settings: EvalSettings, specs: Sequence[str],
        engine_options: dict[str, Any], log: Log = stderr_log) -> tuple[str, list[WeightResult]]:
    """Load the model, evaluate ``specs`` and return the report (header, table, goal and
    outlier lines) with the results."""
    from kvserve.engine.build import resolve_device, resolve_dtype
    from kvserve.model.loader import load_model

    loaded = load_model(model)
    if loaded.tokenizer is None:
        raise ValueError("kvserve eval-weights needs a model with a tokenizer (the workload is text)")
    work = Workload.build(loaded.tokenizer, text, settings)
    results = evaluate_formats(loaded, work, settings, specs, engine_options, log)
    device = resolve_device(engine_options.get("device", "auto"))
    dtype = resolve_dtype(engine_options.get("dtype", "auto"), device, loaded.config.torch_dtype)
    size = file_nbytes(loaded.source)
    lines = [*header_lines(loaded.source, size, str(device), str(dtype), text_label, settings),
             render_table(results, size),
             *[f"goal: {line}" for line in goal_lines(results)],
             *[f"outliers: {line}" for line in outlier_lines(results)]]
    return "\n".join(lines), results
