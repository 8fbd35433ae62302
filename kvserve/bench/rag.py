"""``kvserve bench rag``: answers from k retrieved documents; full prefill, prefix caching, blending.

The workload (rag_workload.py): ``num_docs`` documents, each about ``doc_tokens`` tokens of whole
sentences from the text with one planted fact ("Marta Quill's locker number is 4817.": a made-up
name, an attribute and a 4-digit number, all three distinct per document). A query draws ``k``
documents in random order and asks for one document's number, in SmolLM2's chat template:

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    Find Marta Quill's locker number in the documents below.

    Document 1:
    <document text>

    Document 2:
    ...

    Question: What is Marta Quill's locker number?<|im_end|>
    <|im_start|>assistant
    Marta Quill's locker number is

An answer (greedy, ``max_tokens``) is correct when it holds the planted number, not inside a
longer one. The wording is the one that gave full prefill the most correct answers on the
default 20 queries (k=4 of 12 documents of ~500 tokens, SmolLM2-135M-Instruct), tried in turn
on an earlier draw of the documents: ending at the assistant turn, 1/20 (it describes the
documents); starting the answer ("... is"), 11/20 with one attribute for every document (it
gives another document's number); an attribute per document, 17/20; the question also
before the documents, 20/20 (20/20 on the final documents too, where the question only at
the end gives 13/20). Blending cannot profit from the question up front: a document's
stored KV never saw it (full prefill's 20/20 is the bar; docs/blend.md). ``--question end``
puts it after the documents only (CacheBlend's setting): "Documents:" then the documents,
then the question.

Methods, each its own engine on the one loaded model, the same queries in the same order:

- ``full``: prefix caching off, every prompt computed in full (the reference);
- ``prefix``: prefix caching on; earlier queries warm the cache, so the template's head hits
  (the question differs per query, and documents in another order miss);
- ``blend@f``: prefix caching on, and every document stored as a segment before the first
  query (``LLM.cache_segments``: the RAG premise, documents are reused across queries); each
  prompt goes as a ``SegmentedPrompt`` cut from the same text at its documents, recomputing
  the fraction ``f`` of each document's tokens. The parts are tokenized apart, so their ids
  may differ from the whole text's at the cuts: the output counts the prompts where they do.

Time to first token is ``RequestOutput.ttft``, one query at a time, after one warm-up query
per engine. Query i runs under every method (the first one rotating) before query i + 1, so
drift in a shared machine's load falls on all alike; ``rounds`` repeats the whole pass with
fresh engines. *Agreement*: the share of full prefill's answer tokens a method matches up to
the first difference (and how many answers match all). *Limit*: blending computes the
non-segment tokens in full, every reused token through the first ``select_layer`` layers,
and the recomputed ones through the rest, which bounds its TTFT gain by token counts.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvserve.bench.common import table
from kvserve.bench.rag_itl import DECODE_PROMPT_TOKENS, DECODE_TOKENS, ItlMethod, itl_methods, render_itl, run_itl
from kvserve.bench.rag_workload import (
    QUESTION_PLACES,
    Document,
    Query,
    agreement,
    is_correct,
    make_documents,
    make_queries,
    prompt_text,
    segmented_prompt,
    template_head,
)
from kvserve.blend.calibrated import resolve_selection
from kvserve.blend.prompt import SegmentedPrompt
from kvserve.llm import LLM
from kvserve.options import CommandDefault, add_engine_args
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Method:
    """How the prompts are prefilled: ``blend_fraction`` None gives the prompt as one text."""

    name: str
    is_prefix_caching: bool = True
    blend_fraction: float | None = None
    in_batch: bool | None = None    # ``blend_in_batch`` (None: as the engine options say)


def methods(fractions: Sequence[float], outside_too: bool = False) -> list[Method]:
    """Full prefill, prefix caching, a blend per fraction (and, ``outside_too``, the same blend
    run outside the batch, ``blend_in_batch`` off)."""
    blends = [m for f in fractions for m in (
        Method(f"blend@{f:g}", blend_fraction=f),
        *([Method(f"blend@{f:g} outside", blend_fraction=f, in_batch=False)] if outside_too else []))]
    return [Method("full", is_prefix_caching=False), Method("prefix"), *blends]


class Answer(NamedTuple):
    """One query under one method."""

    ttft_s: float
    token_ids: tuple[int, ...]
    text: str
    is_correct: bool
    num_prompt_tokens: int
    num_cached_tokens: int          # from the prefix cache
    num_reused_tokens: int          # from cached segments (those recomputed included)
    num_recomputed_tokens: int
    num_restored_tokens: int        # segment tokens stored again before the query (evicted since)
    # the query selections' first pass: the text before the first segment (past the prefix
    # cache's) and the question after the last (blending._Context.asking)
    num_asking_tokens: int = 0


def ask(llm: LLM, method: Method, documents: Sequence[Document], query: Query,
        params: SamplingParams, question: str = "both") -> Answer:
    tokenizer = llm.tokenizer
    text = prompt_text(tokenizer, documents, query, question)
    prompt: str | SegmentedPrompt = text
    restored = 0
    if method.blend_fraction is not None:
        # The premise holds for every query: its documents are in the store (0 unless the
        # pool evicted one whole since: a segment that lost only its tail blocks counts as
        # stored and is not completed); not part of the time to first token.
        restored = llm.cache_segments([documents[i].text for i in query.doc_ids])
        prompt = segmented_prompt(text, documents, query, method.blend_fraction)
    out = llm.generate([prompt], params)[0]
    if out.ttft is None:
        raise RuntimeError(f"{method.name}: the request finished without a first token ({out.finish_reason})")
    asking = 0
    if isinstance(prompt, SegmentedPrompt):
        ids, spec = prompt.encode(tokenizer)
        asking = spec.num_asking_tokens(len(ids), out.num_cached_tokens)
    return Answer(out.ttft, tuple(out.token_ids), out.text, is_correct(out.text, documents[query.target].number),
                  out.num_prompt_tokens, out.num_cached_tokens, out.num_reused_tokens,
                  out.num_recomputed_tokens, restored, asking)


def run_round(make_llm: Callable[[Method], LLM], chosen: Sequence[Method], documents: Sequence[Document],
              queries: Sequence[Query], warmup: Query, params: SamplingParams,
              log: Callable[[str], None], question: str = "both") -> dict[str, list[Answer]]:
    """Every query under every method, with fresh engines: each blending engine stores every
    document first, each engine answers ``warmup`` (not counted), then query i runs under every
    method (the first method rotating) before query i + 1, so drift in load falls on all alike."""
    llms = {}
    for m in chosen:
        llm = llms[m.name] = make_llm(m)
        if m.blend_fraction is not None:
            num_stored = llm.cache_segments([d.text for d in documents])
            log(f"{m.name}: {len(documents)} documents stored ({num_stored} tokens)")
        ask(llm, m, documents, warmup, params, question)
    answers: dict[str, list[Answer]] = {m.name: [] for m in chosen}
    for i, query in enumerate(queries):
        for m in [*chosen[i % len(chosen):], *chosen[:i % len(chosen)]]:
            answers[m.name].append(ask(llms[m.name], m, documents, query, params, question))
        log(f"query {i + 1}/{len(queries)}: " + ", ".join(
            f"{m.name} {1000 * answers[m.name][-1].ttft_s:.0f} ms {'ok' if answers[m.name][-1].is_correct else 'wrong'}"
            for m in chosen))
    return answers


@dataclass(frozen=True)
class RagResult:
    """A method's answers over every round (queries in order, round after round), each
    compared with full prefill's answer to the same query in the same round."""

    method: str
    blend_fraction: float | None
    answers: tuple[Answer, ...]
    agreements: tuple[float, ...]       # per answer: ``agreement`` with full prefill's tokens
    num_identical: int                  # answers equal to full prefill's, token for token

    @property
    def num_answers(self) -> int:
        return len(self.answers)

    @property
    def num_correct(self) -> int:
        return sum(a.is_correct for a in self.answers)

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(a.ttft_s for a in self.answers)

    @property
    def ttft_p10_p90_s(self) -> tuple[float, float]:
        ttfts = [a.ttft_s for a in self.answers]
        if len(ttfts) < 2:
            return ttfts[0], ttfts[0]
        deciles = statistics.quantiles(ttfts, n=10, method="inclusive")
        return deciles[0], deciles[-1]

    def mean(self, field: str) -> float:
        """The mean over answers of an ``Answer`` field, e.g. ``num_reused_tokens``."""
        return statistics.fmean(getattr(a, field) for a in self.answers)

    def mean_layer_tokens(self, num_layers: int, select_layer: int, selection: str = "deviation",
                          query_layer: int | None = None) -> float:
        """Tokens per prompt computed, counted in passes through every layer: a token computed
        in full is one; under the deviation selection a reused token ``select_layer / num_layers``
        (the layers that choose what to recompute), a recomputed one that plus
        ``(num_layers - select_layer) / num_layers``; under the query selections a computed token
        one, a recomputed one one, another reused none, and the first pass's tokens
        (``num_asking_tokens``) once more through the layers up to ``query_layer`` (every layer
        when None)."""
        first = 1.0 if query_layer is None else (query_layer + 1) / num_layers

        def one(a: Answer) -> float:
            computed = a.num_prompt_tokens - a.num_cached_tokens - a.num_reused_tokens
            if selection != "deviation" and a.num_reused_tokens:
                return computed + first * a.num_asking_tokens + a.num_recomputed_tokens
            return computed + (a.num_reused_tokens * select_layer
                               + a.num_recomputed_tokens * (num_layers - select_layer)) / num_layers
        return statistics.fmean(one(a) for a in self.answers)


def summarize(chosen: Sequence[Method], rounds: Sequence[dict[str, list[Answer]]]) -> list[RagResult]:
    results = []
    for m in chosen:
        answers = [a for r in rounds for a in r[m.name]]
        reference = [a for r in rounds for a in r["full"]]
        results.append(RagResult(m.name, m.blend_fraction, tuple(answers),
                                 tuple(agreement(a.token_ids, f.token_ids) for a, f in zip(answers, reference)),
                                 sum(a.token_ids == f.token_ids for a, f in zip(answers, reference))))
    return results


def render(results: Sequence[RagResult]) -> str:
    by_name = {r.method: r for r in results}
    full, prefix = by_name["full"].median_ttft_s, by_name["prefix"].median_ttft_s
    rows = []
    for r in results:
        lo, hi = r.ttft_p10_p90_s
        rows.append([r.method, f"{1000 * r.median_ttft_s:.0f}", f"{1000 * lo:.0f}–{1000 * hi:.0f}",
                     f"{full / r.median_ttft_s:.2f}x", f"{prefix / r.median_ttft_s:.2f}x",
                     f"{r.num_correct}/{r.num_answers}", f"{statistics.fmean(r.agreements):.2f}",
                     f"{r.num_identical}/{r.num_answers}", f"{r.mean('num_prompt_tokens'):.0f}",
                     f"{r.mean('num_cached_tokens'):.0f}", f"{r.mean('num_reused_tokens'):.0f}",
                     f"{r.mean('num_recomputed_tokens'):.0f}"])
    return table(["method", "median TTFT ms", "TTFT p10–p90 ms", "full / this", "prefix / this", "correct",
                  "agreement with full", "same tokens as full", "prompt tokens", "prefix-cached", "reused",
                  "recomputed"], rows)


def goal_lines(results: Sequence[RagResult], k: int, num_layers: int, select_layer: int,
               selection: str = "deviation", query_layer: int | None = None) -> list[str]:
    """Per blending method: the two goals of issue 14, and the bound the token counts put on
    the TTFT ratio (attention's growth with length and fixed costs ignored)."""
    by_name = {r.method: r for r in results}
    full, prefix = by_name["full"], by_name["prefix"]
    prefix_tokens = prefix.mean("num_prompt_tokens") - prefix.mean("num_cached_tokens")
    lines = []
    for r in results:
        if r.blend_fraction is None:
            continue
        ratio = prefix.median_ttft_s / r.median_ttft_s
        lines.append(f"goal TTFT >= 3x lower than prefix caching at k={k} ({r.method}): {ratio:.1f}x "
                     f"{'MET' if ratio >= 3 else 'MISSED'}")
        share = r.num_correct / full.num_correct if full.num_correct else None
        verdict = "n/a (full prefill answered none)" if share is None else (
            f"{share:.1%} {'MET' if share >= 0.95 else 'MISSED'}")
        lines.append(f"goal accuracy >= 95% of full prefill's ({r.method}): {r.num_correct}/{r.num_answers} vs "
                     f"{full.num_correct}/{full.num_answers} = {verdict}")
        layer_tokens = r.mean_layer_tokens(num_layers, select_layer, selection, query_layer)
        lines.append(f"limit ({r.method}): computes {layer_tokens:.0f} of {r.mean('num_prompt_tokens'):.0f} prompt "
                     f"tokens per query in whole-model passes, so TTFT at most {prefix_tokens / layer_tokens:.1f}x "
                     f"lower than prefix caching ({prefix_tokens:.0f} computed), "
                     f"{full.mean('num_prompt_tokens') / layer_tokens:.1f}x lower than full")
    return lines


def pool_blocks(documents: Sequence[Document], max_prompt_tokens: int, max_tokens: int, block_size: int,
                num_requests: int) -> int:
    """KV blocks for every document's segment and ``num_requests`` requests side by side: no
    document is evicted, the premise holds throughout (a freed request's blocks hold no key,
    so the next request reuses them before evicting a cached block)."""
    blocks = lambda num_tokens: -(-num_tokens // block_size)
    return sum(blocks(d.num_tokens) for d in documents) + num_requests * blocks(max_prompt_tokens + max_tokens)


DEFAULT_FRACTIONS = (0.05, 0.15, 0.3)
QUESTION_TEXT = {"both": "before and after the documents", "end": "after the documents"}


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from kvserve.bench import plots
    from kvserve.bench.common import find_text, stderr_log, write_plot
    from kvserve.model.loader import load_model
    from kvserve.options import engine_config, engine_options

    log = stderr_log("rag")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ValueError("bench rag needs a model with a tokenizer (the documents are text)")
    documents = make_documents(find_text(args.text), tokenizer, args.num_docs, args.doc_tokens, args.workload_seed)
    *queries, warmup = make_queries(args.num_docs, args.num_queries + 1, args.k, args.workload_seed)
    texts = [prompt_text(tokenizer, documents, q, args.question) for q in queries]
    cut_apart = sum(segmented_prompt(t, documents, q, 0.0).encode(tokenizer)[0] != tokenizer.encode(t)
                    for t, q in zip(texts, queries))
    options = engine_options(args)
    num_kv_blocks = options.pop("num_kv_blocks", None)     # sizes each engine below, one way or the other
    if args.preamble_head:
        if options.get("blend_preamble") is not None:
            raise ValueError("give --preamble-head or --blend-preamble, not both")
        options["blend_preamble"] = template_head(tokenizer)
    cache = engine_config(args.model, **options).cache
    longest = max(len(tokenizer.encode(prompt_text(tokenizer, documents, q, args.question)))
                  for q in [*queries, warmup])
    # the caching engines hold every document and two requests (a finished request's blocks,
    # holding no key, are reused before any cached block is evicted)
    pool = num_kv_blocks or pool_blocks(documents, longest, args.max_tokens, cache.block_size, 2)
    full_pool = num_kv_blocks or pool_blocks([], longest, args.max_tokens, cache.block_size, 1)
    chosen = methods(args.fraction or DEFAULT_FRACTIONS, args.outside_too)
    engines: list[str] = []     # what the engines resolved, for the header

    def make_llm(m: Method) -> LLM:
        llm = LLM(loaded=loaded, enable_prefix_caching=m.is_prefix_caching,
                  num_kv_blocks=pool if m.is_prefix_caching else full_pool, **_with_path(options, m.in_batch))
        engines[:] = [f"device {llm.engine.device}, dtype {llm.engine.dtype}"]
        return llm

    log(f"{len(documents)} documents of {min(d.num_tokens for d in documents)}–"
        f"{max(d.num_tokens for d in documents)} tokens, {len(queries)} queries of k={args.k}; "
        f"KV pools of {pool} blocks ({full_pool} for full prefill)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rounds = []
    for i in range(args.rounds):
        log(f"round {i + 1}/{args.rounds}")
        rounds.append(run_round(make_llm, chosen, documents, queries, warmup, params, log, args.question))
    results = summarize(chosen, rounds)
    print(f"RAG: {len(queries)} queries x {args.rounds} rounds, each k={args.k} of {len(documents)} documents of "
          f"~{args.doc_tokens} tokens, question {QUESTION_TEXT[args.question]}, {args.max_tokens} tokens greedy, "
          f"{loaded.source}, {engines[0]}, "
          f"KV pools of {pool} blocks ({full_pool} for full); TTFT median and p10–p90 over queries")
    print(render(results))
    print(f"\nprompt ids: the parts tokenized apart differ from the whole text's ids in {cut_apart}/{len(queries)} "
          f"prompts; segment tokens stored again after eviction: "
          f"{sum(a.num_restored_tokens for r in results for a in r.answers)}")
    preamble = ("none" if cache.blend_preamble is None
                else f"{len(tokenizer.encode(cache.blend_preamble))} tokens"
                + (" (the prompts' head)" if args.preamble_head else ""))
    selection, query_layer = resolve_selection(cache.blend_selection, cache.blend_query_layer, loaded.fingerprint)
    chose = f" (from {cache.blend_selection})" if selection != cache.blend_selection else ""
    print(f"blend selection: {selection}{chose}, {cache.blend_sink_tokens} sink tokens per segment, "
          f"last {cache.blend_last_segments} segments whole, "
          f"query layer {'all' if query_layer is None else query_layer}, "
          f"segments stored after a preamble: {preamble}")
    for line in goal_lines(results, args.k, loaded.config.num_layers, cache.blend_select_layer,
                           selection, query_layer):
        print(line)
    if args.decoders:
        decoder_blocks = args.decoders * -(-(DECODE_PROMPT_TOKENS + DECODE_TOKENS) // cache.block_size)

        def make_itl_llm(m: ItlMethod) -> LLM:     # the decoders' blocks beside the documents and queries
            return LLM(loaded=loaded, num_kv_blocks=pool + decoder_blocks,
                       **_with_path({**options, "blend_in_steps": m.blend_in_steps}, m.in_batch))

        itl = run_itl(make_itl_llm, itl_methods(args.fraction or DEFAULT_FRACTIONS, args.outside_too), documents,
                      queries, args.decoders, args.question, log)
        print(f"\n{args.decoders} requests decoding beside each query (inter-token latency from the query's arrival "
              f"to its first token; step budget {engine_config(args.model, **options).scheduler.max_num_batched_tokens}"
              f" tokens):")
        print(render_itl(itl))
    write_plot(args.plot, lambda path: plots.plot_rag(results, path))
    _save(args.json, documents, queries, results)
    return 0


def _with_path(options: dict, in_batch: bool | None) -> dict:
    """``options`` with ``blend_in_batch`` set where a method names it."""
    return options if in_batch is None else {**options, "blend_in_batch": in_batch}


def _save(path: str | None, documents: Sequence[Document], queries: Sequence[Query],
          results: Sequence[RagResult]) -> None:
    import json
    from pathlib import Path

    if path:
        Path(path).write_text(json.dumps(
            {"benchmark": "rag", "documents": [d.__dict__ for d in documents],
             "queries": [q.__dict__ for q in queries],
             "results": [{"method": r.method, "blend_fraction": r.blend_fraction, "agreements": r.agreements,
                          "answers": [a._asdict() for a in r.answers]} for r in results]}, indent=2))


def add_rag_parser(bsub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    r = bsub.add_parser("rag", parents=[common],
                        help="answers from k documents: TTFT and accuracy, full prefill vs prefix caching vs blending")
    r.add_argument("--num-docs", type=int, default=12, help="documents in the pool")
    r.add_argument("--doc-tokens", type=int, default=500, help="tokens per document, about")
    r.add_argument("--num-queries", type=int, default=20)
    r.add_argument("--k", type=int, default=4, help="documents per query")
    r.add_argument("--fraction", type=float, action="append", default=None,
                   help=f"blend_fraction (repeatable; default: {', '.join(map(str, DEFAULT_FRACTIONS))})")
    r.add_argument("--max-tokens", type=int, default=8, help="answer length (greedy)")
    r.add_argument("--question", choices=QUESTION_PLACES, default="both",
                   help="where the question goes: before and after the documents, or after them only")
    r.add_argument("--rounds", type=int, default=1, help="passes over the queries, each with fresh engines")
    r.add_argument("--text", default=None, help="text the documents are cut from (default: the shipped botchan.txt)")
    r.add_argument("--seed", type=int, default=0, dest="workload_seed", metavar="SEED")   # the engine's: --engine-seed
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    r.add_argument("--decoders", type=int, default=0,
                   help="also measure the inter-token latency of this many decoding requests while each query "
                        "prefills or blends (kvserve/bench/rag_itl.py)")
    r.add_argument("--outside-too", action="store_true",
                   help="also run every blend outside the batch, on dense tensors (blend_in_batch off: "
                        "'blend@f outside'), beside the engine options' blend (docs/blend.md)")
    r.add_argument("--preamble-head", action="store_true",
                   help="store every document after the prompts' own head (the chat template's system turn and "
                        "the user turn's start), as --blend-preamble with that text (docs/blend.md)")
    add_engine_args(r, ("num_kv_blocks", "blend_cost_model", "blend_select_layer", "blend_selection",
                        "blend_sink_tokens", "blend_last_segments", "blend_query_layer", "blend_preamble",
                        "blend_in_batch"),
                    defaults={"num_kv_blocks": CommandDefault(None, "every document and every request of a round, "
                                                                    "per engine")})
    r.set_defaults(run=run_bench)
