"""``kvserve bench decode``: kvserve against transformers' generate on the same weights."""

from __future__ import annotations

import argparse

import pytest
from tiny import tiny_model

from kvserve import LLM
from kvserve.bench import decode
from kvserve.bench.cli import add_bench_parser


@pytest.mark.parametrize("hf_cache", ["dynamic", "static"])
def test_a_model_without_a_tokenizer_decodes_against_either_transformers_cache(hf_cache):
    loaded = tiny_model()
    llm = LLM(loaded=loaded)
    rows, text = decode.run(loaded, llm, [1, 2], new_tokens=3, repeats=1, hf_cache=hf_cache)
    assert [r[0] for r in rows] == [1, 2]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)      # type: ignore[arg-type]
    assert "| batch | kvserve tok/s | transformers tok/s |" in text
    with pytest.raises(ValueError, match="hf_cache must be one of dynamic, static, got 'paged'"):
        decode.run(loaded, llm, [1], new_tokens=3, repeats=1, hf_cache="paged")


def test_decode_takes_a_random_model_the_static_cache_and_cuda_graphs():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "decode", "--random-model", "qwen2.5-coder-1.5b", "--hf-cache", "static",
                              "--cuda-graphs", "--batch-sizes", "1,16"])
    assert (args.random_model, args.hf_cache, args.cuda_graphs, args.batch_sizes) == (
        "qwen2.5-coder-1.5b", "static", True, "1,16")
    plain = parser.parse_args(["bench", "decode"])
    assert (plain.random_model, plain.hf_cache, plain.cuda_graphs) == (None, "dynamic", False)
