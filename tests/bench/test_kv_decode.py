"""``kvserve bench kv-decode`` on the tiny model: steps taken apart, the table, its flags."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from tiny import random_tokens, tiny_model

from kvserve.bench import kv_decode
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.random_model import SHAPES, random_model, random_token_ids


def test_a_decode_step_is_taken_apart_into_products_attention_and_the_rest():
    loaded = tiny_model()
    text = random_tokens(400, seed=0, vocab_size=loaded.config.vocab_size)
    results = kv_decode.run(loaded, text, ["native", "int8"], ["auto", "torch"], num_seqs=2, context=40, steps=5,
                            repeats=2, kv_cache_gb=0.01, log=lambda m: None,
                            engine_options={"weight_format": "int8"})
    assert [(r.kv_format, r.backend, r.weight_format) for r in results] == [
        ("native", "cpu", "int8"), ("native", "torch", "int8"), ("int8", "cpu", "int8"), ("int8", "torch", "int8")]
    for r in results:
        assert len(r.tok_s) == 2 and r.median > 0
        assert 0 < r.products_ms < r.step_ms
        if r.backend == "torch":               # the torch path reads through gather: not timed apart
            assert r.attention_ms is None and r.rest_ms is None
        else:
            assert r.attention_ms is not None and r.rest_ms is not None
            assert abs(r.products_ms + r.attention_ms + r.rest_ms - r.step_ms) < 1e-9
    table = kv_decode.render(results, 2, bandwidth=30e9)
    assert "| products ms | attend ms | rest ms |" in table


def test_interleaved_repeats_run_in_rounds_and_give_each_row_over_the_first_per_round():
    loaded = tiny_model()
    text = random_tokens(400, seed=0, vocab_size=loaded.config.vocab_size)
    logged: list[str] = []
    results = kv_decode.run(loaded, text, ["native", "int8", "kivi2g8"], ["auto"], num_seqs=2, context=40, steps=5,
                            repeats=3, kv_cache_gb=0.01, log=logged.append, interleave=True)
    assert [r.kv_format for r in results] == ["native", "int8", "kivi2g8"]
    rounds = [m for m in logged if m.startswith("round ")]
    assert [m.split(":")[0] for m in rounds] == ["round 1", "round 2", "round 3"]
    assert all(m.count(" / cpu ") == 3 for m in rounds)
    first = results[0].tok_s
    for r in results:
        assert len(r.tok_s) == 3 and r.vs_first == [x / f for x, f in zip(r.tok_s, first)]
    assert results[0].vs_first == [1.0, 1.0, 1.0]
    table = kv_decode.render(results, 2, bandwidth=30e9)
    assert "| vs first row, per round |" in table and "1.000x (1.000-1.000)" in table
    plain = kv_decode.render([replace(r, vs_first=None) for r in results], 2, bandwidth=30e9)
    assert "per round" not in plain


def test_kv_decode_takes_json_plot_and_the_weight_format(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "kv-decode", "--json", str(tmp_path / "r.json"), "--plot",
                              str(tmp_path / "r.png"), "--weight-format", "native"])
    assert (args.json, args.plot, args.weight_format) == (str(tmp_path / "r.json"), str(tmp_path / "r.png"), "native")
    assert not args.interleave
    assert parser.parse_args(["bench", "kv-decode", "--interleave"]).interleave


def test_json_rows_carry_the_derived_figures_and_draw_the_plot(tmp_path):
    from kvserve.bench import plots

    results = [kv_decode.DecodeResult("native", "cpu", 1 << 20, 1 << 26, [90.0, 100.0, 95.0], 40.0, 30.0, 5.0, "gguf"),
               kv_decode.DecodeResult("int8", "torch", 1 << 18, 1 << 26, [150.0], 20.0, None, 5.0, "gguf")]
    rows = kv_decode.result_rows(results)
    assert rows[0] == {"kv_format": "native", "backend": "cpu", "kv_bytes_per_step": 1 << 20,
                       "weight_bytes": 1 << 26, "tok_s": [90.0, 100.0, 95.0], "step_ms": 40.0, "attention_ms": 30.0,
                       "products_ms": 5.0, "weight_format": "gguf", "vs_first": None, "graphs": False,
                       "graph_steps": None, "median": 95.0, "rest_ms": 5.0}
    assert (rows[1]["median"], rows[1]["rest_ms"]) == (150.0, None)
    path = tmp_path / "kv.png"
    assert plots.PLOTS["kv-decode"](rows, path) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_random_models_have_the_real_files_shapes(default_model):
    """SmolLM2-135M's shape as its GGUF gives it (the 1.5B's was taken from its file the same way);
    a random model of it, with fewer layers, decodes through the bench."""
    assert replace(SHAPES["smollm2-135m"], torch_dtype="float32", rms_norm_eps=default_model.config.rms_norm_eps) \
        == default_model.config
    loaded = random_model("smollm2-135m", num_layers=2)
    assert loaded.config.num_layers == 2 and loaded.tokenizer is None
    assert sorted(loaded.weights) == sorted(n for n in default_model.weights if not n.startswith("model.layers.")
                                            or n.startswith(("model.layers.0.", "model.layers.1.")))
    text = random_token_ids(200, loaded.config.vocab_size)
    (result,) = kv_decode.run(loaded, text, ["native"], ["auto"], num_seqs=1, context=64, steps=3, repeats=1,
                              kv_cache_gb=0.05, log=lambda m: None)
    assert result.median > 0 and not result.graphs and result.graph_steps is None
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        random_model("gpt-5")


def test_graphs_off_cuda_are_refused_before_any_run():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "kv-decode", "--random-model", "smollm2-135m", "--graphs", "both",
                              "--device", "cpu"])
    with pytest.raises(ValueError, match="--graphs both: CUDA graphs need a CUDA device, this run is on cpu"):
        kv_decode.run_bench(args)


def test_a_graphs_row_the_engine_refuses_is_left_out_and_said():
    """With graphs both, a configuration whose engine refuses graphs (here: no CUDA; on a GPU a
    KIVI format) keeps its eager row and logs why it has no other."""
    loaded = tiny_model()
    text = random_tokens(400, seed=0, vocab_size=loaded.config.vocab_size)
    logged: list[str] = []
    for interleave in (False, True):
        results = kv_decode.run(loaded, text, ["native", "int8"], ["auto"], num_seqs=2, context=40, steps=3,
                                repeats=1, kv_cache_gb=0.01, log=logged.append, interleave=interleave,
                                graphs=(False, True))
        assert [(r.kv_format, r.graphs) for r in results] == [("native", False), ("int8", False)]
    refused = [m for m in logged if "no row with CUDA graphs" in m]
    assert refused == 2 * [f"{f} / auto: no row with CUDA graphs (cuda_graphs: CUDA graphs need a CUDA device, the "
                           "engine is on cpu)" for f in ("native", "int8")]
