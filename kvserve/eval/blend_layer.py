"""``kvserve eval-blend-layer``: which layer ``query-segments`` should read, for this model.

``blend_selection="query-segments"`` recomputes the documents the question attends to most
at one layer (``blend_query_layer``, docs/blend.md). Which layer finds the right document
depends on the model, so it is measured: on ``bench rag``'s workload (documents with a
planted fact each, queries over k of them asking for one fact), every layer's first-pass
attention scores the documents (``segment_peaks_by_layer``: one first pass per query, every
layer read), and a layer scores a hit when
it ranks the asked document first. The layer with the most hits is the one to pass.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NamedTuple

from kvserve.bench.common import table
from kvserve.bench.rag_workload import Document, Query, prompt_text, segmented_prompt
from kvserve.blend.blending import BlendPrompt, segment_peaks_by_layer
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import SegmentKV, compute_kv
from kvserve.llm import LLM
from kvserve.options import add_engine_args


class LayerHits(NamedTuple):
    hits: tuple[int, ...]        # per layer: queries whose asked document it ranked first
    num_queries: int

    @property
    def best_layer(self) -> int:
        """The layer with the most hits (the lower of equals)."""
        return max(range(len(self.hits)), key=lambda layer: (self.hits[layer], -layer))


def layer_hits(llm: LLM, documents: Sequence[Document], queries: Sequence[Query], question: str = "both",
               preamble: str | None = None) -> LayerHits:
    """``preamble``: the documents are stored after this text (``blend_preamble``), as the
    engine would store them."""
    model, tokenizer = llm.engine.model, llm.tokenizer
    if tokenizer is None:
        raise ValueError("eval-blend-layer needs a model with a tokenizer (the documents are text)")
    rope = RopeTables(model.config)
    head = () if preamble is None else tuple(tokenizer.encode(preamble))
    standalone: dict[tuple[int, ...], SegmentKV] = {}
    hits = [0] * model.config.num_layers
    for query in queries:
        text = prompt_text(tokenizer, documents, query, question)
        ids, spec = segmented_prompt(text, documents, query, 0.0).encode(tokenizer)
        segments = [tuple(ids[start:start + n]) for start, n in spec.spans]
        for seg in segments:
            if seg not in standalone:
                standalone[seg] = compute_kv(model, seg, preamble=head, rope=rope)
        cached = [standalone[seg] for seg in segments]
        peaks = segment_peaks_by_layer(model, rope, BlendPrompt(tuple(ids), spec.spans), cached)
        target = query.doc_ids.index(query.target)
        for layer, scores in enumerate(peaks):
            hits[layer] += max(range(len(scores)), key=scores.__getitem__) == target
    return LayerHits(tuple(hits), len(queries))


def render(result: LayerHits) -> str:
    rows = [[layer, f"{n}/{result.num_queries}"] for layer, n in enumerate(result.hits)]
    return table(["layer", "asked document ranked first"], rows)


def run_eval_blend_layer(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench.common import find_text
    from kvserve.bench.rag_workload import make_documents, make_queries, template_head

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_kv_blocks=16)
    if llm.tokenizer is None:
        raise ValueError("eval-blend-layer needs a model with a tokenizer (the documents are text)")
    documents = make_documents(find_text(args.text), llm.tokenizer, args.num_docs, args.doc_tokens, args.workload_seed)
    queries = make_queries(args.num_docs, args.num_queries, args.k, args.workload_seed)
    if args.preamble_head and args.blend_preamble is not None:
        raise ValueError("give --preamble-head or --blend-preamble, not both")
    preamble = template_head(llm.tokenizer) if args.preamble_head else args.blend_preamble
    result = layer_hits(llm, documents, queries, args.question, preamble)
    stored = "" if preamble is None else f", documents stored after a {len(llm.tokenizer.encode(preamble))}-token preamble"
    print(f"{len(queries)} queries of k={args.k} of {len(documents)} documents of ~{args.doc_tokens} tokens "
          f"(question {args.question}{stored}); per layer, the queries whose asked document the question's "
          f"first-pass attention ranks first (its largest weight past a document's first 32 tokens):")
    print(render(result))
    best = result.best_layer
    advice = "--blend-sink-tokens 32" if preamble is None else "and the same blend_preamble"
    print(f"best: layer {best} ({result.hits[best]}/{result.num_queries}); use "
          f"--blend-selection query-segments --blend-query-layer {best} {advice}")
    return 0


def add_eval_blend_layer_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval-blend-layer", help="the layer blend_query_layer should read for this model "
                                                "(query-segments blending), measured on RAG queries")
    e.add_argument("--model", default=None)
    e.add_argument("--text", default=None, help="text the documents are cut from (default: the shipped botchan.txt)")
    e.add_argument("--num-docs", type=int, default=12)
    e.add_argument("--doc-tokens", type=int, default=500)
    e.add_argument("--num-queries", type=int, default=20)
    e.add_argument("--k", type=int, default=4, help="documents per query")
    e.add_argument("--question", choices=("both", "end"), default="both")
    add_engine_args(e, ("blend_preamble",))      # the documents are stored after it, as the engine stores segments
    e.add_argument("--preamble-head", action="store_true",
                   help="store the documents after the prompts' own head (the chat template's text before the "
                        "user message), as bench rag --preamble-head")
    e.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    e.set_defaults(run=run_eval_blend_layer)
