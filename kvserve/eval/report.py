"""The results table and the goal checks of issue 3."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.bench.common import table
from kvserve.eval.harness import FormatResult

# names of the rows the goals compare
FP16, INT8, KIVI4, KIVI2 = "fp16", "int8", "kivi4", "kivi2"
HF2 = "hf-quanto2"


def _pct(x: float) -> str:
    return f"{x:+.2f}%"


def _passkey(cell: tuple[int, int] | None) -> str:
    return "—" if cell is None else f"{cell[0]}/{cell[1]}"


def render_table(results: Sequence[FormatResult], fp32_bytes: float, fp16_bytes: float,
                 lengths: Sequence[int]) -> str:
    base = _baseline(results)
    headers = ["format", "engine", "bytes/token", "vs fp32", "vs fp16",
               f"bytes/token @{_ctx(results)}", "perplexity", f"Δ vs {base.name}" if base else "Δ",
               "agreement", *[f"passkey {n // 1024}k" if n % 1024 == 0 else f"passkey {n}" for n in lengths],
               "passkey", "time (s)"]
    rows = []
    for r in results:
        s = r.storage
        ppl = r.ppl.perplexity if r.ppl else None
        delta = (_pct(100 * (ppl / base.ppl.perplexity - 1)) if ppl is not None and base and base.ppl else "—")
        total = r.passkey_total
        rows.append([
            r.name, r.engine, f"{s.bytes_per_token:,.0f}", f"{fp32_bytes / s.bytes_per_token:.2f}x",
            f"{fp16_bytes / s.bytes_per_token:.2f}x", f"{s.bytes_per_token_at_context:,.0f}",
            f"{ppl:.3f}" if ppl is not None else "—", delta,
            f"{r.agreement:.3f}" if r.agreement is not None else "—",
            *[_passkey(r.passkey.get(n)) for n in lengths],
            f"{total[0]}/{total[1]}" if total else "—", f"{r.seconds:.0f}"])
    return table(headers, rows)


def _ctx(results: Sequence[FormatResult]) -> str:
    n = results[0].storage.context_tokens if results else 0
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def _baseline(results: Sequence[FormatResult]) -> FormatResult | None:
    by_name = {r.name: r for r in results if r.ppl is not None}
    return by_name.get(FP16) or by_name.get("native")


def goal_lines(results: Sequence[FormatResult]) -> list[str]:
    """Issue 3's goals, each 'met' or 'MISSED' with its numbers (skipped when a row is absent)."""
    by = {r.name: r for r in results}
    lines = []

    def ppl_goal(name: str, limit_pct: float) -> None:
        a, b = by.get(name), by.get(FP16)
        if a and b and a.ppl and b.ppl:
            d = 100 * (a.ppl.perplexity / b.ppl.perplexity - 1)
            lines.append(f"{name} perplexity within {limit_pct}% of fp16: {_pct(d)} "
                         f"({a.ppl.perplexity:.3f} vs {b.ppl.perplexity:.3f}): {'met' if d <= limit_pct else 'MISSED'}")

    ppl_goal(INT8, 0.5)
    ppl_goal(KIVI4, 2.0)
    k2, hf2 = by.get(KIVI2), by.get(HF2)
    if k2 and hf2 and k2.ppl and hf2.ppl:
        better = k2.ppl.perplexity < hf2.ppl.perplexity
        fewer = k2.storage.bytes_per_token <= hf2.storage.bytes_per_token
        fewer_ctx = k2.storage.bytes_per_token_at_context <= hf2.storage.bytes_per_token_at_context
        lines.append(
            f"kivi2 better perplexity than transformers 2-bit: {k2.ppl.perplexity:.3f} vs "
            f"{hf2.ppl.perplexity:.3f}: {'met' if better else 'MISSED'}; bytes/token {k2.storage.bytes_per_token:,.0f} "
            f"vs {hf2.storage.bytes_per_token:,.0f} compressed only ({'no more' if fewer else 'MORE'}), "
            f"{k2.storage.bytes_per_token_at_context:,.0f} vs {hf2.storage.bytes_per_token_at_context:,.0f} "
            f"with full-precision residuals ({'no more' if fewer_ctx else 'MORE'})")
    k4, f16 = by.get(KIVI4), by.get(FP16)
    if k4 and f16 and k4.passkey_total and f16.passkey_total:
        same = k4.passkey_total[0] == f16.passkey_total[0]
        lines.append(f"kivi4 passkey accuracy equal to fp16: {k4.passkey_total[0]}/{k4.passkey_total[1]} vs "
                     f"{f16.passkey_total[0]}/{f16.passkey_total[1]}: {'met' if same else 'MISSED'}")
    return lines


def to_json(results: Sequence[FormatResult]) -> list[dict[str, Any]]:
    return [{"name": r.name, "engine": r.engine, "bytes_per_token": r.storage.bytes_per_token,
             "bytes_per_token_at_context": r.storage.bytes_per_token_at_context,
             "context_tokens": r.storage.context_tokens,
             "perplexity": r.ppl.perplexity if r.ppl else None,
             "nll_sum": r.ppl.nll_sum if r.ppl else None, "num_scored": r.ppl.num_scored if r.ppl else None,
             "agreement": r.agreement, "passkey": {str(k): list(v) for k, v in r.passkey.items()},
             "seconds": r.seconds} for r in results]
