"""``kvserve bench rag --decoders N``: what a RAG prompt costs the requests already decoding.

N requests decode (greedy, ``DECODE_TOKENS`` each, replaced as they finish) while each query's
prompt is prefilled (``prefix``: chunks of the step's token budget) or blended (``blend@f``: as
the engine options say, by default its rows chosen a step's budget of work at a time outside
the batch, then computed as chunks of the steps, ``blend_in_batch``; with ``--outside-too``,
``blend@f outside``: the whole blend outside the batch, a few layers per step, at most the
step's token budget of work; ``blend@f whole``: the blend outside the batch run whole before
one step, ``--no-blend-in-batch --no-blend-in-steps``). From the
query's arrival to its first token, every gap between two tokens of a decoding request is an
inter-token latency (ITL) sample (the first counted from the query's arrival); ``alone`` is the decoders with no query, the same number
of steps, the floor. Query i runs under every method before query i + 1.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.bench.common import table
from kvserve.bench.rag_workload import Document, Query, prompt_text, segmented_prompt
from kvserve.bench.serve import percentile
from kvserve.blend.prompt import SegmentedPrompt
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

DECODE_PROMPT_TOKENS = 32
DECODE_TOKENS = 256


@dataclass(frozen=True)
class ItlMethod:
    name: str
    blend_fraction: float | None = None     # None: the prompt as one text (prefix caching)
    blend_in_steps: bool = True
    in_batch: bool | None = None            # ``blend_in_batch`` (None: as the engine options say)


@dataclass
class ItlResult:
    name: str
    gaps_s: list[float] = field(default_factory=list)     # decoders' inter-token latencies during queries
    ttft_s: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)        # engine steps from a query's arrival to its first token


def itl_methods(fractions: Sequence[float], outside_too: bool = False) -> list[ItlMethod]:
    return [ItlMethod("prefix"), *(m for f in fractions for m in (
        ItlMethod(f"blend@{f:g}", f),
        *([ItlMethod(f"blend@{f:g} outside", f, in_batch=False)] if outside_too else []),
        ItlMethod(f"blend@{f:g} whole", f, blend_in_steps=False, in_batch=False)))]


class Decoders:
    """``n`` greedy requests kept decoding on ``llm``'s engine, and their token times."""

    def __init__(self, llm: LLM, n: int) -> None:
        self.engine = llm.engine
        self.n = n
        self.params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        self.last: dict[str, float] = {}      # decoding request -> when its last token came
        self.serial = 0
        while len(self.last) < n:
            self._start()
        while any(t == 0.0 for t in self.last.values()):    # every one past its prefill
            self.step()

    def _start(self) -> None:
        self.serial += 1
        rid = f"decoder-{self.serial}"
        prompt = [(7 * self.serial + i) % 1000 + 10 for i in range(DECODE_PROMPT_TOKENS)]
        self.engine.add_request(prompt, self.params, request_id=rid)
        self.last[rid] = 0.0

    def resume(self) -> None:
        """Count the next gaps from now: the engine sat idle since (other methods' engines ran)."""
        now = time.perf_counter()
        self.last = dict.fromkeys(self.last, now)

    def step(self, gaps: list[float] | None = None) -> list:
        """One engine step; each decoder token's gap since its previous one into ``gaps``.
        Returns the step's other outputs."""
        outs = self.engine.step()
        now = time.perf_counter()
        others = []
        for o in outs:
            if o.request_id not in self.last:
                others.append(o)
                continue
            if gaps is not None and self.last[o.request_id]:
                gaps.append(now - self.last[o.request_id])
            self.last[o.request_id] = now
            if o.finished:
                del self.last[o.request_id]
                self._start()
        return others


def run_itl(make_llm: Callable[[ItlMethod], LLM], chosen: Sequence[ItlMethod], documents: Sequence[Document],
            queries: Sequence[Query], num_decoders: int, question: str,
            log: Callable[[str], None]) -> list[ItlResult]:
    llms = {m.name: make_llm(m) for m in chosen}
    decoders = {}
    for m in chosen:
        if m.blend_fraction is not None:
            llms[m.name].cache_segments([d.text for d in documents])
        decoders[m.name] = Decoders(llms[m.name], num_decoders)
    results = {m.name: ItlResult(m.name) for m in chosen}
    alone = ItlResult("alone (no query)")
    for i, query in enumerate(queries):
        for m in [*chosen[i % len(chosen):], *chosen[:i % len(chosen)]]:
            llm, dec, res = llms[m.name], decoders[m.name], results[m.name]
            text = prompt_text(llm.tokenizer, documents, query, question)
            prompt: str | SegmentedPrompt = text
            if m.blend_fraction is not None:
                llm.cache_segments([documents[d].text for d in query.doc_ids])
                prompt = segmented_prompt(text, documents, query, m.blend_fraction)
            dec.resume()
            rid = llm.engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            start, steps = time.perf_counter(), 0
            while not any(o.request_id == rid and o.finished for o in dec.step(res.gaps_s)):
                steps += 1
            res.ttft_s.append(time.perf_counter() - start)
            res.steps.append(steps + 1)
            if m is chosen[0]:      # the floor: as many steps of the decoders alone
                dec.resume()
                for _ in range(steps + 1):
                    dec.step(alone.gaps_s)
        log(f"itl query {i + 1}/{len(queries)}: " + ", ".join(
            f"{m.name} p99 {1000 * percentile(results[m.name].gaps_s, 0.99):.0f} ms" for m in chosen))
    return [alone, *results.values()]


def render_itl(results: Sequence[ItlResult]) -> str:
    ms = lambda s: f"{1000 * s:,.0f}"
    rows = [[r.name, len(r.gaps_s), ms(percentile(r.gaps_s, 0.5)), ms(percentile(r.gaps_s, 0.99)),
             ms(max(r.gaps_s, default=0.0)), ms(statistics.median(r.ttft_s)) if r.ttft_s else "-",
             f"{statistics.fmean(r.steps):.1f}" if r.steps else "-"] for r in results]
    return table(["method", "ITL samples", "ITL p50 ms", "p99", "max", "query TTFT median ms", "steps to first token"],
                 rows)
