"""``kvserve eval-weights``: the report and goals on synthetic rows, the command line, one
end-to-end run on the tiny model, and the shipped evaluation text."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

import pytest

from kvserve.bench.common import find_text
from kvserve.cli import build_parser
from kvserve.eval.cli import DEFAULT_WEIGHT_FORMATS, ppl_stride, run_eval_weights
from kvserve.eval.harness import EvalSettings, Workload
from kvserve.eval.perplexity import PerplexityResult
from kvserve.eval.weights import (
    WeightResult,
    delta_pct,
    evaluate_formats,
    goal_lines,
    outlier_lines,
    render_table,
    to_json,
    weight_settings,
    with_native_first,
)
from tests.tiny import random_tokens, tiny_model

MIB = 1 << 20


def row(name: str, mib: float, ppl: float, prefix_lens: tuple[int, ...] = (32, 32, 32, 32),
        spec: str | None = None) -> WeightResult:
    share = sum(prefix_lens) / (32 * len(prefix_lens))
    return WeightResult(spec or name, name, int(mib * MIB), PerplexityResult(math.log(ppl) * 100, 100), share,
                        prefix_lens, 32, 1.0)


RESULTS = [row("native", 512, 20.0), row("gguf", 92, 20.05, (32, 32, 20, 8)), row("int8", 160, 20.2),
           row("int4", 96, 20.5), row("int4+out8", 100, 20.3), row("int8+out8", 164, 20.1)]


def test_goals_say_met_or_missed_with_the_numbers():
    assert goal_lines(RESULTS) == [
        "gguf perplexity within 0.5% of native: +0.25% (20.050 vs 20.000), greedy agreement 0.719: met",
        "int8 perplexity within 0.5% of native: +1.00% (20.200 vs 20.000), greedy agreement 1.000: MISSED",
        "int4 perplexity within 3% of native: +2.50% (20.500 vs 20.000), greedy agreement 1.000: met"]


def test_outlier_lines_set_each_outN_row_against_its_format_without_outliers():
    assert outlier_lines(RESULTS) == [
        ("int4+out8 vs int4: perplexity 20.300 vs 20.500 (-0.98%; vs native +1.50% vs +2.50%), "
         "greedy agreement 1.000 vs 1.000"),
        ("int8+out8 vs int8: perplexity 20.100 vs 20.200 (-0.50%; vs native +0.50% vs +1.00%), "
         "greedy agreement 1.000 vs 1.000")]
    assert outlier_lines([RESULTS[0], RESULTS[4]]) == []       # int4 itself did not run


def test_goals_skip_rows_that_were_not_run_and_key_on_the_resolved_format():
    auto = row("gguf", 92, 20.2, spec="auto")
    assert goal_lines([RESULTS[0], auto, RESULTS[1]]) == [
        "gguf perplexity within 0.5% of native: +1.00% (20.200 vs 20.000), greedy agreement 1.000: MISSED"]
    assert goal_lines(RESULTS[:1]) == []


def test_table_has_the_bytes_ratios_deltas_and_divergence():
    lines = render_table(RESULTS, 94 * MIB).splitlines()
    assert len(lines) == 2 + len(RESULTS)
    assert "first divergence (of 32)" in lines[0]
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert cells == ["gguf", "92.0", "5.57x", "0.98x", "20.050", "+0.25%", "0.719", "23.0", "2/4", "1"]
    native = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert native[2:8] == ["1.00x", "5.45x", "20.000", "+0.00%", "1.000", "32.0"] and native[8] == "0/4"
    no_file = [c.strip() for c in render_table([row("gguf", 92, 20.0, spec="auto"), *RESULTS[:1]], None)
               .splitlines()[2].split("|")[1:-1]]
    assert no_file[0] == "auto (gguf)" and no_file[3] == "—"


def test_result_properties_and_json():
    gguf = RESULTS[1]
    assert gguf.mean_divergence == 23.0 and gguf.num_diverged == 2
    assert delta_pct(RESULTS[0], RESULTS[0]) == 0.0
    rows = to_json(RESULTS)
    assert rows[1]["name"] == "gguf" and rows[1]["prefix_lens"] == [32, 32, 20, 8]
    assert rows[1]["weight_nbytes"] == 92 * MIB and rows[1]["delta_pct"] == pytest.approx(0.25)


def test_command_line():
    args = build_parser().parse_args(["eval-weights", "--format", "int8", "--format", "int4-g64+out8",
                                      "--ppl-tokens", "512", "--threads", "2", "--device", "cpu", "--json", "w.json"])
    assert args.run is run_eval_weights
    assert args.format == ["int8", "int4-g64+out8"] and args.threads == 2 and args.json == "w.json"
    assert args.device == "cpu" and args.text is None
    assert (args.ppl_tokens, args.window, ppl_stride(args), args.chunk, args.num_prompts, args.agree_tokens) == \
        (512, 1024, 512, 64, 8, 32)
    assert args.ppl_layout == "sliding"
    halves = build_parser().parse_args(["eval-weights", "--ppl-layout", "halves", "--stride", "100"])
    with pytest.raises(SystemExit, match="no stride"):
        ppl_stride(halves)
    defaults = build_parser().parse_args(["eval-weights"])
    assert defaults.format is None and defaults.ppl_tokens == 2048
    assert DEFAULT_WEIGHT_FORMATS == ("native", "gguf", "int8", "int8-ch", "int4", "int4+out8", "int4-g64",
                                      "int4-g64+out8", "int8+out8")
    assert weight_settings(512) == EvalSettings(ppl_tokens=512, passkey_lengths=(), tasks=("ppl", "agree"))


def test_native_runs_first_as_the_reference():
    assert with_native_first(["int8", "native", "int4"]) == ["native", "int8", "int4"]
    assert with_native_first(["int8"]) == ["native", "int8"]
    with pytest.raises(ValueError, match="int5"):
        evaluate_formats(tiny_model(), Workload([1, 2], [], []), weight_settings(), ["int8", "int5"], {},
                         log=lambda _: None)


def test_end_to_end_on_the_tiny_model():
    """auto is native for float weights: a second native engine must agree exactly."""
    settings = weight_settings(ppl_tokens=96, window=48, stride=24, chunk=16, num_prompts=2, agree_tokens=6)
    work = Workload(random_tokens(96, 1), [random_tokens(12, 2), random_tokens(20, 3)], [])
    results = evaluate_formats(tiny_model(), work, settings, ["auto", "int8", "int4"],
                               {"device": "cpu", "num_kv_blocks": 64, "max_num_seqs": 4}, log=lambda _: None)
    assert [(r.spec, r.name) for r in results] == [("native", "native"), ("auto", "native"), ("int8", "int8"),
                                                   ("int4", "int4")]
    native, again, int8, int4 = results
    assert again.ppl == native.ppl and delta_pct(again, native) == 0.0
    assert native.agreement == again.agreement == 1.0 and again.prefix_lens == (6, 6)
    for r in results:
        assert r.ppl.num_scored == 95 and math.isfinite(r.ppl.perplexity)
        assert 0.0 <= r.agreement <= 1.0 and len(r.prefix_lens) == 2 and r.agree_tokens == 6
    assert native.weight_nbytes > int8.weight_nbytes > int4.weight_nbytes
    assert [line.split(" perplexity")[0] for line in goal_lines(results)] == ["int8", "int4"]
    assert len(render_table(results, None).splitlines()) == 2 + 4


def test_find_text_reads_the_shipped_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)          # no data folder beside the working directory
    text = find_text()
    assert text == resources.files("kvserve").joinpath("data/botchan.txt").read_text(encoding="utf-8")
    assert "BOTCHAN" in text[:200]
    (tmp_path / "mine.txt").write_text("hello", encoding="utf-8")
    assert find_text("mine.txt") == "hello"
    with pytest.raises(ValueError, match="no text file missing.txt"):
        find_text("missing.txt")
