"""The results table, the goal checks and the command lines."""

from __future__ import annotations

import math

import pytest

from kvserve.cli import build_parser
from kvserve.eval.backends import StorageCost
from kvserve.eval.cli import DEFAULT_FORMATS, settings_from
from kvserve.eval.harness import EvalSettings, FormatResult
from kvserve.eval.perplexity import PerplexityResult
from kvserve.eval.report import goal_lines, render_table
from kvserve.eval.runner import DENSE, units_for


def row(name: str, engine: str, bpt: float, ppl: float, passkey: int, at_ctx: float | None = None) -> FormatResult:
    return FormatResult(name, engine, StorageCost(bpt, at_ctx or bpt * 1.1, 1024),
                        PerplexityResult(math.log(ppl) * 100, 100), 0.5, {1024: (passkey, 5)}, 1.0)


RESULTS = [row("native", "kvserve", 46080, 30.0, 5), row("fp16", "kvserve", 23040, 30.0, 5),
           row("int8", "kvserve", 11880, 30.1, 5), row("kivi4", "kvserve", 7920, 31.0, 4),
           row("kivi2", "kvserve", 5040, 40.0, 2, at_ctx=6000), row("hf-quanto2", "transformers", 4320, 90.0, 0,
                                                                     at_ctx=12000)]


def test_table_has_a_row_per_configuration_and_the_compression_ratios():
    text = render_table(RESULTS, 46080, 23040, [1024])
    lines = text.splitlines()
    assert len(lines) == 2 + len(RESULTS)
    kivi2 = next(line for line in lines[2:] if line.split("|")[1].strip() == "kivi2")
    assert "9.14x" in kivi2 and "4.57x" in kivi2 and "+33.33%" in kivi2 and "2/5" in kivi2
    assert "Δ vs fp16" in lines[0]


def test_goals_say_met_or_missed_with_the_numbers():
    lines = goal_lines(RESULTS)
    assert len(lines) == 4
    int8, kivi4, kivi2, passkey = lines
    assert int8.startswith("int8") and "+0.33%" in int8 and int8.endswith("met")
    assert kivi4.startswith("kivi4") and "+3.33%" in kivi4 and kivi4.endswith("MISSED")
    assert "40.000 vs 90.000: met" in kivi2 and "compressed only (MORE)" in kivi2
    assert "with full-precision residuals (no more)" in kivi2
    assert passkey.endswith("4/5 vs 5/5: MISSED")


def test_goals_skip_rows_that_were_not_run():
    assert goal_lines(RESULTS[:3]) == [goal_lines(RESULTS)[0]]


def test_eval_command_line_builds_settings():
    args = build_parser().parse_args([
        "eval", "--format", "int8", "--format", "k=kivi4,v=kivi2", "--ppl-tokens", "512", "--chunk", "32",
        "--passkey-lengths", "256,512", "--passkey-depths", "0,0.5,1", "--tasks", "ppl,passkey", "--jobs", "2"])
    s = settings_from(args)
    assert args.format == ["int8", "k=kivi4,v=kivi2"] and args.jobs == 2
    assert s == EvalSettings(ppl_tokens=512, chunk=32, passkey_lengths=(256, 512), passkey_depths=(0.0, 0.5, 1.0),
                             tasks=("ppl", "passkey"))
    with pytest.raises(ValueError, match="unknown tasks"):
        EvalSettings(tasks=("ppl", "speed"))


def test_units_put_the_dense_transformers_run_before_its_quantized_caches():
    units = units_for(DEFAULT_FORMATS, (4, 2))
    assert [u.name for u in units[:len(DEFAULT_FORMATS)]] == list(DEFAULT_FORMATS)
    assert [(u.name, u.nbits) for u in units[len(DEFAULT_FORMATS):]] == [(DENSE, None), ("hf-quanto4", 4),
                                                                         ("hf-quanto2", 2)]
    assert [u.name for u in units_for(["int8"], ())] == ["int8"]


def test_capacity_command_line():
    args = build_parser().parse_args(["bench", "capacity", "--format", "kivi2", "--kv-cache-gb", "0.1"])
    assert args.format == ["kivi2"] and args.kv_cache_memory_gb == 0.1 and args.prompt_tokens == 1000
