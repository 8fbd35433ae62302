"""``kvserve eval-blend-layer``: the per-layer count and the layer it names."""

from __future__ import annotations

import argparse

from kvserve.bench.common import find_text
from kvserve.bench.rag_workload import make_documents, make_queries
from kvserve.eval import blend_layer
from kvserve.eval.blend_layer import LayerHits
from kvserve.llm import LLM


def test_the_best_layer_has_the_most_hits_the_lower_of_equals():
    assert LayerHits((1, 3, 2, 3), 4).best_layer == 1
    assert LayerHits((0, 0), 4).best_layer == 0
    lines = blend_layer.render(LayerHits((1, 3, 2, 3), 4)).splitlines()
    assert [line.replace(" ", "") for line in lines[2:]] == ["|0|1/4|", "|1|3/4|", "|2|2/4|", "|3|3/4|"]


def test_a_tiny_calibration_on_the_default_model(default_model):
    """Three short documents, three queries: one count per layer, each of the queries, the same
    twice (the first pass is deterministic)."""
    llm = LLM(loaded=default_model, num_kv_blocks=16)
    documents = make_documents(find_text(), llm.tokenizer, 3, 64, seed=0)
    queries = make_queries(3, 3, 2, seed=0)
    result = blend_layer.layer_hits(llm, documents, queries)
    assert result.num_queries == 3 and len(result.hits) == default_model.config.num_layers == 30
    assert all(0 <= h <= 3 for h in result.hits) and sum(result.hits) > 0
    assert blend_layer.layer_hits(llm, documents, queries) == result


def test_documents_stored_after_a_preamble(default_model, monkeypatch):
    """``preamble``: each distinct document computed once, after the preamble's tokens (what
    ``blend_preamble`` stores), the first pass as before."""
    from kvserve.bench.rag_workload import template_head

    llm = LLM(loaded=default_model, num_kv_blocks=16)
    documents = make_documents(find_text(), llm.tokenizer, 3, 64, seed=0)
    queries = make_queries(3, 3, 2, seed=0)
    calls = []
    compute_kv = blend_layer.compute_kv

    def recorded(model, token_ids, *args, **kwargs):
        calls.append((tuple(token_ids), tuple(kwargs.get("preamble", ()))))
        return compute_kv(model, token_ids, *args, **kwargs)

    monkeypatch.setattr(blend_layer, "compute_kv", recorded)
    head = template_head(llm.tokenizer)
    result = blend_layer.layer_hits(llm, documents, queries, preamble=head)
    assert result.num_queries == 3 and len(result.hits) == 30
    assert len(calls) == len({ids for ids, _ in calls}) == len({d for q in queries for d in q.doc_ids})   # once each
    assert {p for _, p in calls} == {tuple(llm.tokenizer.encode(head))}


def test_the_command_parses():
    from kvserve.cli import build_parser
    args = build_parser().parse_args(["eval-blend-layer", "--num-queries", "5", "--k", "2"])
    assert (args.num_queries, args.k, args.num_docs, args.run) == (5, 2, 12, blend_layer.run_eval_blend_layer)
    assert isinstance(args, argparse.Namespace)
    args = build_parser().parse_args(["eval-blend-layer", "--preamble-head"])
    assert args.preamble_head and args.blend_preamble is None
