"""``kvserve bench rag``: the documents, queries, scoring and report exactly; one tiny real run."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from kvserve.bench import plots, rag, rag_itl
from kvserve.bench.cli import add_bench_parser
from kvserve.bench.common import find_text
from kvserve.bench.rag import Answer, Method, RagResult
from kvserve.bench.rag_workload import (
    Query,
    agreement,
    is_correct,
    make_documents,
    make_queries,
    prompt_text,
    segmented_prompt,
    sentences,
)
from kvserve.blend.prompt import Segment
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def text() -> str:
    return find_text()


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


@pytest.fixture(scope="module")
def documents(text, tokenizer):
    return make_documents(text, tokenizer, 12, 500, seed=0)


def test_each_document_holds_its_fact_once_and_no_other(documents):
    everything = "\n".join(d.text for d in documents)
    for d in documents:
        assert d.text.count(d.fact) == 1
        assert len(re.findall(rf"(?<!\d){d.number}(?!\d)", everything)) == 1
        assert everything.count(d.name) == 1
        assert not d.text.startswith(d.fact) and not d.text.endswith(d.fact)   # between two sentences
    assert len({d.name for d in documents}) == len({d.name.split()[0] for d in documents}) == 12
    assert len({d.name.split()[1] for d in documents}) == len({d.attribute for d in documents}) == 12
    assert len({d.number for d in documents}) == 12


def test_documents_are_near_the_target_length_and_apart_in_the_text(text, tokenizer, documents):
    for d in documents:
        assert d.num_tokens == len(tokenizer.encode(d.text))
        assert abs(d.num_tokens - 500) <= 25, d.num_tokens
    flat = " ".join(sentences(text))
    starts = [flat.find(d.text.replace(d.fact + " ", "")) for d in documents]
    assert all(s >= 0 for s in starts)          # whole sentences of the text, in order, fact aside
    ends = [s + len(d.text) - len(d.fact) - 1 for s, d in zip(starts, documents)]
    assert all(end <= start for end, start in zip(ends, starts[1:]))     # in text order, no overlap


def test_documents_are_seeded(text, tokenizer, documents):
    assert make_documents(text, tokenizer, 12, 500, seed=0) == documents
    assert make_documents(text, tokenizer, 12, 500, seed=1) != documents


def test_documents_refuse_what_the_text_cannot_hold(text, tokenizer):
    with pytest.raises(ValueError, match="too short"):
        make_documents(text[:20_000], tokenizer, 12, 500, seed=0)
    with pytest.raises(ValueError, match="num_docs"):
        make_documents(text, tokenizer, 21, 100, seed=0)


def test_queries_draw_k_distinct_documents_in_random_order():
    queries = make_queries(12, 50, 4, seed=0)
    assert len(queries) == 50
    for q in queries:
        assert len(q.doc_ids) == len(set(q.doc_ids)) == 4
        assert all(0 <= i < 12 for i in q.doc_ids)
        assert q.target in q.doc_ids
    assert any(list(q.doc_ids) != sorted(q.doc_ids) for q in queries)
    assert len({q.doc_ids.index(q.target) for q in queries}) == 4     # the target at every place
    assert make_queries(12, 50, 4, seed=0) == queries
    assert make_queries(12, 50, 4, seed=1) != queries
    with pytest.raises(ValueError, match="k must be"):
        make_queries(3, 1, 4, seed=0)


def test_correct_means_the_number_stands_alone():
    assert is_correct(" 4817.", "4817")
    assert is_correct("The code is 4817 I think", "4817")
    assert not is_correct(" 48170", "4817")
    assert not is_correct(" 14817", "4817")
    assert not is_correct(" 48 17", "4817")
    assert not is_correct("", "4817")


def test_agreement_is_the_common_prefix_over_full_prefills_length():
    assert agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert agreement([1, 2, 4], [1, 2, 3]) == pytest.approx(2 / 3)
    assert agreement([1, 9, 3], [1, 2, 3]) == pytest.approx(1 / 3)     # up to the first difference
    assert agreement([9, 2, 3], [1, 2, 3]) == 0.0
    assert agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert agreement([1, 2, 3], [1, 2]) == 1.0
    assert agreement([], []) == 1.0


def test_the_question_goes_before_and_after_the_documents_or_after_only(tokenizer, documents):
    query = Query((5, 0, 9), target=9)
    asked = f"{documents[9].name}'s {documents[9].attribute}"
    both, end = prompt_text(tokenizer, documents, query, "both"), prompt_text(tokenizer, documents, query, "end")
    assert both.count(asked) == 4 and end.count(asked) == 3      # the fact, the question(s), the answer's start
    assert both.index(f"Find {asked}") < both.index(documents[5].text)
    assert end.index("Documents:") < end.index(documents[5].text) < end.index(f"What is {asked}?")
    with pytest.raises(ValueError, match="question must be one of"):
        prompt_text(tokenizer, documents, query, "middle")


def test_the_prompt_cuts_into_the_querys_documents(tokenizer, documents):
    query = Query((5, 0, 9), target=0)
    text = prompt_text(tokenizer, documents, query)
    target = documents[0]
    assert text.endswith(f"<|im_start|>assistant\n{target.name}'s {target.attribute} is")
    assert text.count(f"What is {target.name}'s {target.attribute}?") == 1
    assert [text.find(documents[i].text) for i in query.doc_ids] == sorted(text.find(documents[i].text)
                                                                           for i in query.doc_ids)
    prompt = segmented_prompt(text, documents, query, 0.15)
    assert [p.content for p in prompt.parts if isinstance(p, Segment)] == [documents[i].text for i in (5, 0, 9)]
    ids, spec = prompt.encode(tokenizer)
    assert "".join(p if isinstance(p, str) else str(p.content) for p in prompt.parts) == text
    assert [ids[s:s + n] for s, n in spec.spans] == [tokenizer.encode(documents[i].text) for i in (5, 0, 9)]
    assert spec.fraction == 0.15


def answer(ttft_s: float, token_ids: tuple[int, ...], correct: bool, cached: int = 0, reused: int = 0,
           recomputed: int = 0) -> Answer:
    return Answer(ttft_s, token_ids, "", correct, num_prompt_tokens=1000, num_cached_tokens=cached,
                  num_reused_tokens=reused, num_recomputed_tokens=recomputed, num_restored_tokens=0)


def hand_made_results() -> list[RagResult]:
    chosen = rag.methods([0.1])
    full = [answer(1.0 + i / 10, (1, 2, 3), True) for i in range(4)]
    prefix = [answer(0.9, (1, 2, 3), True, cached=100) for _ in range(4)]
    blend = [answer(0.2, (1, 2, 3), True, 100, 800, 80), answer(0.3, (1, 5, 3), True, 100, 800, 80),
             answer(0.25, (7, 2, 3), False, 100, 800, 80), answer(0.4, (1, 2, 3), False, 100, 800, 80)]
    return rag.summarize(chosen, [{"full": full[:2], "prefix": prefix[:2], "blend@0.1": blend[:2]},
                                  {"full": full[2:], "prefix": prefix[2:], "blend@0.1": blend[2:]}])


def test_results_compare_each_answer_with_full_prefills_in_its_round():
    full, prefix, blend = hand_made_results()
    assert [r.method for r in (full, prefix, blend)] == ["full", "prefix", "blend@0.1"]
    both = rag.methods([0.1], outside_too=True)
    assert [(m.name, m.in_batch) for m in both[2:]] == [("blend@0.1", None), ("blend@0.1 outside", False)]
    assert blend.agreements == pytest.approx((1.0, 1 / 3, 0.0, 1.0))
    assert (full.num_identical, prefix.num_identical, blend.num_identical) == (4, 4, 2)
    assert (blend.num_correct, blend.num_answers) == (2, 4)
    assert blend.median_ttft_s == pytest.approx(0.275)
    assert blend.ttft_p10_p90_s == pytest.approx((0.215, 0.37))
    assert full.median_ttft_s == pytest.approx(1.15)
    # 100 computed in full, 800 reused through 1 of 30 layers, 80 of them through 29 more
    assert blend.mean_layer_tokens(num_layers=30, select_layer=1) == pytest.approx(100 + (800 + 80 * 29) / 30)
    # the query selections: 100 computed, 80 recomputed, the first pass's 40 through 15 of 30 layers
    asked = dataclasses.replace(blend, answers=tuple(a._replace(num_asking_tokens=40) for a in blend.answers))
    assert asked.mean_layer_tokens(30, 1, "query-segments", query_layer=14) == pytest.approx(100 + 40 * 15 / 30 + 80)
    assert asked.mean_layer_tokens(30, 1, "query") == pytest.approx(100 + 40 + 80)


def test_goal_lines_say_met_or_missed_with_the_bound():
    results = hand_made_results()
    lines = rag.goal_lines(results, k=4, num_layers=30, select_layer=1)
    assert lines[0] == "goal TTFT >= 3x lower than prefix caching at k=4 (blend@0.1): 3.3x MET"
    assert lines[1] == "goal accuracy >= 95% of full prefill's (blend@0.1): 2/4 vs 4/4 = 50.0% MISSED"
    assert lines[2] == ("limit (blend@0.1): computes 204 of 1000 prompt tokens per query in whole-model passes, "
                        "so TTFT at most 4.4x lower than prefix caching (900 computed), 4.9x lower than full")
    header, _, *rows = [[c.strip() for c in line.strip("|").split("|")] for line in rag.render(results).splitlines()]
    assert header[:6] == ["method", "median TTFT ms", "TTFT p10–p90 ms", "full / this", "prefix / this", "correct"]
    assert rows[2][:8] == ["blend@0.1", "275", "215–370", "4.18x", "3.27x", "2/4", "0.58", "2/4"]


def test_the_pool_holds_every_document_and_every_request(documents):
    request = -(-(2000 + 8) // 16)
    assert rag.pool_blocks(documents, 2000, 8, 16, 21) == sum(-(-d.num_tokens // 16) for d in documents) + 21 * request
    assert rag.pool_blocks([], 2000, 8, 16, 1) == request == 126


def test_bench_rag_parses_and_draws(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "rag", "--fraction", "0.1", "--fraction", "0.5", "--plot", "x.png"])
    assert (args.fraction, args.k, args.num_docs, args.doc_tokens, args.plot) == ([0.1, 0.5], 4, 12, 500, "x.png")
    assert args.run is rag.run_bench
    path = plots.plot_rag(hand_made_results(), tmp_path / "rag.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_tiny_run_end_to_end(default_model, text):
    """Three short documents, two queries of two, every method: the structure of the results,
    full prefill the same twice (fresh engines), and blending reusing the documents' tokens."""
    tokenizer = default_model.tokenizer
    documents = make_documents(text, tokenizer, 3, 64, seed=0)
    *queries, warmup = make_queries(3, 3, 2, seed=0)
    chosen = rag.methods([0.5])
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def make_llm(m: Method) -> LLM:
        return LLM(loaded=default_model, enable_prefix_caching=m.is_prefix_caching, num_kv_blocks=64)

    rounds = [rag.run_round(make_llm, chosen, documents, queries, warmup, params, lambda _: None) for _ in range(2)]
    assert [a.token_ids for a in rounds[0]["full"]] == [a.token_ids for a in rounds[1]["full"]]
    results = rag.summarize(chosen, rounds)
    assert [r.method for r in results] == ["full", "prefix", "blend@0.5"]
    full, prefix, blend = results
    assert full.num_answers == prefix.num_answers == blend.num_answers == 4
    assert all(len(a.token_ids) == 2 and a.ttft_s > 0 for r in results for a in r.answers)
    assert full.agreements == (1.0,) * 4 and full.num_identical == 4
    assert all(a.num_cached_tokens == 0 and a.num_reused_tokens == 0 for a in full.answers)
    assert all(a.num_cached_tokens > 0 for a in prefix.answers)          # the template's head, from the warm-up
    assert all(a.num_asking_tokens == 0 for a in full.answers + prefix.answers)
    for a, q in zip(blend.answers, queries * 2):
        doc_tokens = sum(documents[i].num_tokens for i in q.doc_ids)
        assert 0 < a.num_reused_tokens <= doc_tokens
        assert a.num_recomputed_tokens <= a.num_reused_tokens
        assert a.num_restored_tokens == 0
        # the first pass's: the text before the first document (past the cached) and after the last
        text = prompt_text(tokenizer, documents, q)
        first, last = documents[q.doc_ids[0]].text, documents[q.doc_ids[-1]].text
        before, after = text[:text.find(first)], text[text.rfind(last) + len(last):]
        assert a.num_asking_tokens == len(tokenizer.encode(before)) - a.num_cached_tokens + len(tokenizer.encode(after))


def test_decoders_beside_the_queries_get_a_token_every_step(default_model, text):
    """``--decoders``: two requests decode while each query prefills in chunks (prefix), blends
    with its rows in the batch, blends a few layers a step outside it, or blends whole; each step
    gives each decoder a token (one ITL sample), the whole blend takes one step, the others more."""
    tokenizer = default_model.tokenizer
    documents = make_documents(text, tokenizer, 3, 64, seed=0)
    queries = make_queries(3, 2, 2, seed=1)

    def make_llm(m: rag_itl.ItlMethod) -> LLM:
        return LLM(loaded=default_model, num_kv_blocks=128, max_num_batched_tokens=32,
                   blend_in_steps=m.blend_in_steps, blend_cost_model=False,
                   **({} if m.in_batch is None else {"blend_in_batch": m.in_batch}))

    chosen = rag_itl.itl_methods([0.5], outside_too=True)
    assert [m.name for m in chosen] == ["prefix", "blend@0.5", "blend@0.5 outside", "blend@0.5 whole"]
    results = rag_itl.run_itl(make_llm, chosen, documents, queries, 2, "both", lambda _: None)
    alone, prefix, in_batch, stepped, whole = results
    assert [r.name for r in results] == ["alone (no query)", "prefix", "blend@0.5", "blend@0.5 outside",
                                         "blend@0.5 whole"]
    assert whole.steps == [1, 1] and all(s > 1 for r in (prefix, in_batch, stepped) for s in r.steps)
    for r in (prefix, in_batch, stepped, whole):
        assert len(r.ttft_s) == 2 and len(r.gaps_s) == 2 * sum(r.steps)
    assert len(alone.gaps_s) == 2 * sum(prefix.steps)          # the first method's steps, decoders alone
    assert "blend@0.5 whole" in rag_itl.render_itl(results)
