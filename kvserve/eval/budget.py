"""``kvserve eval-budget``: each KV budget policy at each budget against the full cache,
in one run: passkey accuracy, perplexity, KV memory and decode speed.

For each context length C (tokens):

* passkey: a needle at each depth in C tokens of filler (botchan.txt sentences by
  default), answered in a few greedy tokens;
* perplexity: the C first tokens of the text as the prompt, then the next
  ``ppl_tokens`` tokens fed one per decode step (teacher forcing: a sampler that
  returns the true token and records its logprob), so every scored token sees the
  budgeted cache;
* KV memory: the pool's high-water mark of blocks in use (peak, including the prefill,
  and during decode), and the host bytes ``arkvale`` parks;
* decode speed: the forced decode steps of the perplexity run.

Prefills are shared where that is exact: policies that change nothing before the end of
the prefill (the full cache, snapkv, pyramid, arkvale) reuse, from the prefix cache, a
warm-up of all but the last ``WARM_GAP`` prompt tokens (so snapkv's 32-token window is
computed); policies that evict during the prefill (streaming, h2o, merge) run cold. Under a
``zip:`` KV format every row runs cold: which blocks a prompt keeps refined depends on the
request that ranked them (a warm-up would rank them by its own last window), and the only
policy there is ``saliency-blocks`` (docs/budgets.md, "Budgets under precision by saliency").

``bits/el`` is the KV held during decode per element of the context at its longest (the
context and the scored tokens; an element is one layer's key or value of one head and
channel): a token evicted counts as 0 bits, one kept as its format's bits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.bench.common import table
from kvserve.engine.engine import LLMEngine
from kvserve.eval.passkey import build_cases, is_correct
from kvserve.kv.budget.policies import get_policy
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from kvserve.request import Request
from kvserve.sampling.rows import RowRequest
from kvserve.sampling.sampler import Sampled, Sampler
from kvserve.sampling_params import SamplingParams

WARM_GAP = 48          # prompt tokens left out of the shared warm-up
PROMPT_OVERHEAD = 64   # passkey head + needle + question, about


@dataclass(frozen=True)
class BudgetEvalSettings:
    contexts: tuple[int, ...] = (2048, 4096)
    fractions: tuple[float, ...] = (0.125, 0.25)     # budget = fraction x context
    policies: tuple[str, ...] = ("streaming", "h2o", "snapkv", "pyramid", "merge", "arkvale", "arkvale-bound")
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    filler: str = "text"
    answer_tokens: int = 8
    ppl_tokens: int = 64
    chunk: int = 512
    seed: int = 0
    kv_format: str = "native"     # every row's, the full cache's too

    def __post_init__(self) -> None:
        for name in self.policies:
            get_policy(name)
        if self.kv_format.startswith("zip:") and set(self.policies) - {"saliency-blocks"}:
            raise ValueError(f"under a zip: KV format the only budget policy is saliency-blocks (docs/budgets.md), got "
                             f"{', '.join(self.policies)}")
        if not all(0 < f < 1 for f in self.fractions):
            raise ValueError(f"budget fractions must be in (0, 1), got {self.fractions}")
        if min(self.contexts) <= PROMPT_OVERHEAD + WARM_GAP:
            raise ValueError(f"contexts must exceed {PROMPT_OVERHEAD + WARM_GAP} tokens, got {self.contexts}")
        for name in ("answer_tokens", "ppl_tokens", "chunk"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name.replace('_', '-')} must be at least 2, got {getattr(self, name)}")


@dataclass(frozen=True)
class Config:
    policy: str | None      # None: the full cache
    budget: int | None

    @property
    def name(self) -> str:
        return "full" if self.policy is None else f"{self.policy}@{self.budget}"

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              kv_budget=self.budget, kv_policy=self.policy)

    @property
    def reuses_prefill(self) -> bool:
        return self.policy is None or not get_policy(self.policy).evicts_in_prefill


@dataclass
class Row:
    context: int
    config: Config
    passkey: list[bool] = field(default_factory=list)
    nll_sum: float = 0.0
    num_scored: int = 0
    peak_blocks: int = 0
    decode_blocks: int = 0
    host_nbytes: int = 0
    decode_seconds: float = 0.0
    decode_tokens: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_scored) if self.num_scored else float("nan")


class ForcedSampler(Sampler):
    """The eval's engine's sampler (LLMEngine's ``sampler``): a request given targets (``force``)
    gets each next true token, its logprob recorded; the others are sampled as by the engine's own."""

    def __init__(self, seed: int, eos_token_ids: Collection[int] = ()) -> None:
        super().__init__(seed, eos_token_ids)
        self.targets: dict[str, list[int]] = {}
        self.target_logprobs: dict[str, list[float]] = {}

    def force(self, request_id: str, targets: list[int]) -> None:
        self.targets[request_id] = targets
        self.target_logprobs[request_id] = []

    def sample(self, logits: torch.Tensor, requests: Sequence[RowRequest], undrawn: Collection[int] = ()) -> Sampled:
        out = super().sample(logits, requests, undrawn)
        for row, req in enumerate(requests):
            assert isinstance(req, Request), "the forced engine does not speculate: every row is a request"
            forced = self.targets.get(req.request_id)
            if forced is not None:
                token = forced[req.num_output_tokens]
                self.target_logprobs[req.request_id].append(float(torch.log_softmax(logits[row], -1)[token]))
                out.token_ids[row] = token
                out.errors.pop(row, None)
        return out


def run_one(engine: LLMEngine, forced: ForcedSampler, ids: list[int], params: SamplingParams, row: Row,
            targets: list[int] | None = None) -> list[int]:
    """Run one request alone (``targets``: forced, scored), adding its memory and decode figures to ``row``."""
    rid = engine.add_request(ids, params)
    if targets is not None:
        forced.force(rid, targets)
    engine.kv.take_peak_used()
    decode_start = None
    tokens: list[int] = []
    finished = False
    while not finished:
        for out in engine.step():
            if out.request_id == rid:
                tokens, finished = out.token_ids, out.finished
        # the budgets' own figure: a whole engine.stats() each step would add to the decode time measured
        row.host_nbytes = max(row.host_nbytes, engine.kv.budgets.host_nbytes)
        if decode_start is None and tokens:
            row.peak_blocks = max(row.peak_blocks, engine.kv.take_peak_used())
            decode_start = time.perf_counter()
    peak = engine.kv.take_peak_used()
    row.peak_blocks = max(row.peak_blocks, peak)
    row.decode_blocks = max(row.decode_blocks, peak)
    if targets is not None and decode_start is not None:
        row.decode_seconds += time.perf_counter() - decode_start
        row.decode_tokens += len(tokens) - 1
        row.nll_sum -= sum(forced.target_logprobs[rid])
        row.num_scored += len(forced.target_logprobs[rid])
    if targets is not None:
        forced.targets.pop(rid)
        forced.target_logprobs.pop(rid)
    return list(tokens)


def configs_for(context: int, settings: BudgetEvalSettings, block_size: int) -> list[Config]:
    out = [Config(None, None)]
    for f in settings.fractions:
        budget = max(2 * block_size, int(context * f) // block_size * block_size)
        out += [Config(p, budget) for p in settings.policies]
    return out


def evaluate_context(llm: LLM, forced: ForcedSampler, context: int, text_ids: list[int], text: str, settings: BudgetEvalSettings,
                     log=print) -> list[Row]:
    engine = llm.engine
    tok = llm.tokenizer
    configs = configs_for(context, settings, engine.config.cache.block_size)
    rows = {c: Row(context, c) for c in configs}
    cases = build_cases(tok.encode, [context - PROMPT_OVERHEAD], settings.depths, settings.seed,
                        settings.filler, text)
    ppl_prompt = text_ids[:context]
    ppl_targets = text_ids[context:context + settings.ppl_tokens]
    prompts = [(c.token_ids, c) for c in cases] + [(ppl_prompt, None)]
    shares = engine.kv_format.refine is None        # (module docstring)
    for ids, case in prompts:
        llm.reset_prefix_cache()
        if shares:
            llm.generate(ids[:len(ids) - WARM_GAP], SamplingParams(max_tokens=1))   # the shared warm-up
        for config in sorted(configs, key=lambda c: not c.reuses_prefill):
            if not config.reuses_prefill or not shares:
                llm.reset_prefix_cache()
            row = rows[config]
            t0 = time.perf_counter()
            if case is None:
                run_one(engine, forced, ids, config.params(len(ppl_targets)), row, ppl_targets)
                what = f"ppl {row.perplexity:.3f}"
            else:
                answer = tok.decode(run_one(engine, forced, ids, config.params(settings.answer_tokens), row))
                row.passkey.append(is_correct(case, answer))
                what = f"passkey depth {case.depth:g} {'ok' if row.passkey[-1] else 'MISS'} {answer.strip()[:24]!r}"
            log(f"{context} {config.name}: {what} ({time.perf_counter() - t0:.1f} s)")
    return [rows[c] for c in configs]


def speed_lines(rows: Sequence[Row]) -> list[str]:
    """Per context, each budgeted row's decode tok/s as a multiple of the full cache's (the
    same run, same steps), and the slowest: what "a budget pays in speed" is judged by."""
    lines = []
    for context in sorted({r.context for r in rows}):
        here = [r for r in rows if r.context == context]
        full = next((r for r in here if r.config.policy is None), None)
        if full is None or not full.decode_tokens or not full.decode_seconds:
            continue
        full_tps = full.decode_tokens / full.decode_seconds
        ratios = [(r.config.name, r.decode_tokens / r.decode_seconds / full_tps)
                  for r in here if r.config.policy is not None and r.decode_seconds]
        if ratios:
            slowest = min(ratios, key=lambda nr: nr[1])
            lines.append(f"{context} tokens, decode tok/s vs full ({full_tps:.1f}): "
                         + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios)
                         + f"; slowest {slowest[0]} {slowest[1]:.2f}x")
    return lines


def render(rows: Sequence[Row], block_nbytes: int, elements_per_token: int, scored_tokens: int) -> str:
    """The table; ``bits/el`` over ``elements_per_token`` per token of the context and the
    ``scored_tokens`` after it (module docstring)."""
    full = {r.context: r for r in rows if r.config.policy is None}
    headers = ["context", "policy", "budget", "passkey", "vs full", "perplexity", "Δ ppl",
               "peak KV MiB", "decode KV MiB", "bits/el", "host MiB", "decode tok/s"]
    body = []
    for r in rows:
        f = full.get(r.context)
        ok, n = sum(r.passkey), len(r.passkey)
        vs = "—" if f is None or not sum(f.passkey) else f"{100 * ok / sum(f.passkey):.0f}%"
        dppl = "—" if f is None or r is f else f"{100 * (r.perplexity / f.perplexity - 1):+.1f}%"
        tps = r.decode_tokens / r.decode_seconds if r.decode_seconds else float("nan")
        body.append([r.context, r.config.policy or "full", r.config.budget or "—", f"{ok}/{n}", vs,
                     f"{r.perplexity:.3f}", dppl, f"{r.peak_blocks * block_nbytes / 2**20:.1f}",
                     f"{r.decode_blocks * block_nbytes / 2**20:.1f}",
                     f"{8 * r.decode_blocks * block_nbytes / ((r.context + scored_tokens) * elements_per_token):.2f}",
                     f"{r.host_nbytes / 2**20:.1f}",
                     f"{tps:.1f}"])
    return table(headers, body)


def goal_lines(rows: Sequence[Row], settings: BudgetEvalSettings) -> list[str]:
    """The issue's goal: arkvale at 1/8 of the context keeps >= 90% of the full cache's
    passkey accuracy; streaming at the same budget, for comparison."""
    lines = []
    for context in sorted({r.context for r in rows}):
        by = {r.config.name: r for r in rows if r.context == context}
        full = by.get("full")
        budget = max(32, int(context / 8) // 16 * 16)
        ark, stream = by.get(f"arkvale@{budget}"), by.get(f"streaming@{budget}")
        if full is None or ark is None:
            continue
        need = 0.9 * sum(full.passkey)
        met = sum(ark.passkey) >= need
        line = (f"{context} tokens, budget {budget} (1/8): arkvale passkey {sum(ark.passkey)}/{len(ark.passkey)} vs "
                f"full {sum(full.passkey)}/{len(full.passkey)}: {'met' if met else 'MISSED'} (needs >= {need:.1f})")
        if stream is not None:
            line += f"; streaming {sum(stream.passkey)}/{len(stream.passkey)}"
        lines.append(line)
    return lines


def evaluate(loaded: LoadedModel, text: str, settings: BudgetEvalSettings, kv_cache_gb: float,
             log=print) -> list[Row]:
    if loaded.tokenizer is None:
        raise ValueError("kvserve eval-budget needs a model with a tokenizer")
    forced = ForcedSampler(0, loaded.config.eos_token_ids)
    llm = LLM(loaded=loaded, sampler=forced, max_num_batched_tokens=settings.chunk, kv_cache_memory_gb=kv_cache_gb,
              max_num_seqs=1, kv_format=settings.kv_format)
    text_ids = llm.tokenizer.encode(text)
    longest = max(settings.contexts) + settings.ppl_tokens
    if len(text_ids) < longest:
        raise ValueError(f"the text has {len(text_ids)} tokens; the longest context needs {longest}")
    if longest > llm.engine.max_model_len:
        raise ValueError(f"context {max(settings.contexts)} + {settings.ppl_tokens} scored tokens exceeds the "
                         f"model's window of {llm.engine.max_model_len}")
    rows: list[Row] = []
    for context in settings.contexts:
        rows += evaluate_context(llm, forced, context, text_ids, text, settings, log)
    return rows
