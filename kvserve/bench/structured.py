"""``kvserve bench structured``: the cost of a JSON-schema constraint per generated token.

For each batch size, the same chat prompts run twice, taking turns (median of ``repeats``
runs after a warm-up, prefix cache reset before each, so both prefill alike): constrained
by a JSON schema, and unconstrained with ``max_tokens`` set to the token count each
constrained answer had (eos ignored), so both generate exactly the same tokens count in
the same batches. The forward passes are then the same work; what the constraint adds is
in sampling (the logits copy, the grammar's mask, applying it, accepting the token), so
the sampler's time is measured in both runs, per generated token, and the difference is
the constraint's cost; the grammar's own share (llguidance's mask + accept, timed around
its matcher) is beside it. Wall time per token is shown too: on a quiet machine its
difference agrees; on a shared one, the forward passes' noise swamps it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.common import median_times, table
from kvserve.llm import LLM
from kvserve.sampling.rows import RowRequest
from kvserve.sampling.sampler import Sampled
from kvserve.sampling.structured import GrammarMatcher
from kvserve.sampling_params import SamplingParams, StructuredOutputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "colour", "tags", "address"],
    "additionalProperties": False,
}
TOPICS = ["a pilot", "a baker", "a poet", "a nurse", "a farmer", "a judge", "a sailor", "a chef",
          "a student", "a painter", "a miner", "a doctor", "a singer", "a king", "a teacher", "a diver"]


class _Clock:
    """Seconds spent, by what: ``fill`` and ``accept`` (the grammar), ``sample`` (the whole
    sampler call of a step, masks included) under the current ``mode``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.mode = ""

    def add(self, what: str, seconds: float) -> None:
        key = f"{self.mode}:{what}"
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds


class _TimedMatcher:
    """A GrammarMatcher that reports the time it spends to a ``_Clock``."""

    def __init__(self, inner: GrammarMatcher, clock: _Clock) -> None:
        self._inner, self._clock = inner, clock

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        start = time.perf_counter()
        self._inner.fill_bitmask(bitmask, row)
        self._clock.add("fill", time.perf_counter() - start)

    def accept(self, token_id: int) -> None:
        start = time.perf_counter()
        self._inner.accept(token_id)
        self._clock.add("accept", time.perf_counter() - start)

    @property
    def is_finished(self) -> bool:
        return self._inner.is_finished

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self._inner.valid_prefix(tokens)

    def masks_after(self, tokens: Sequence[int], words: int) -> list[torch.Tensor]:
        start = time.perf_counter()
        try:
            return self._inner.masks_after(tokens, words)
        finally:
            self._clock.add("fill", time.perf_counter() - start)


def compile_ms(llm: LLM) -> float:
    """Milliseconds to check a schema never seen and make its first matcher."""
    fresh = StructuredOutputs(json=json.dumps({**SCHEMA, "description": f"fresh {time.time_ns()}"}))
    start = time.perf_counter()
    llm.engine.grammars.check(fresh)
    llm.engine.grammars.matcher(fresh)
    return 1000 * (time.perf_counter() - start)


def run(llm: LLM, batch_sizes: list[int], max_tokens: int,
        repeats: int) -> tuple[list[dict[str, float]], str]:
    """One row per batch size: tokens, wall ms per token with and without the constraint,
    sampling ms per token with and without it (the only part of a step the constraint
    changes: the forward passes are the same), the grammar's own share; and the table."""
    engine = llm.engine
    if engine.tokenizer is None:
        raise ValueError("the structured benchmark needs a model with a tokenizer")
    constraint = StructuredOutputs(json=json.dumps(SCHEMA))
    structured = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=constraint)
    clock = _Clock()
    real_matcher, real_sample = engine.grammars.matcher, engine.sampler.sample

    def timed_sample(logits: torch.Tensor, requests: Sequence[RowRequest], undrawn: Collection[int] = ()) -> Sampled:
        start = time.perf_counter()
        try:
            return real_sample(logits, requests, undrawn)
        finally:
            clock.add("sample", time.perf_counter() - start)

    engine.grammars.matcher = (  # type: ignore[method-assign]
        lambda spec: _TimedMatcher(real_matcher(spec), clock))  # type: ignore[assignment,return-value]
    engine.sampler.sample = timed_sample  # type: ignore[method-assign]
    rows: list[dict[str, float]] = []
    try:
        for bs in batch_sizes:
            prompts = [engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}]) for i in range(bs)]
            outs = llm.generate(prompts, structured)
            for o in outs:
                json.loads(o.text)   # the constraint held (max_tokens is large enough to finish)
            lengths = [len(o.token_ids) for o in outs]
            plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
            num_tokens = sum(lengths)

            def constrained(prompts: list[str] = prompts) -> None:
                clock.mode = "json"
                llm.reset_prefix_cache()
                llm.generate(prompts, structured)

            def baseline(prompts: list[str] = prompts, plain: list[SamplingParams] = plain) -> None:
                clock.mode = "plain"
                llm.reset_prefix_cache()
                llm.generate(prompts, plain)

            clock.seconds.clear()
            t_constrained, t_base = median_times([constrained, baseline], repeats)
            per_token = 1000 / ((repeats + 1) * num_tokens)   # every call counts: warm-up and repeats
            t = clock.seconds
            rows.append({
                "batch": bs, "tokens": num_tokens,
                "baseline_ms": 1000 * t_base / num_tokens, "constrained_ms": 1000 * t_constrained / num_tokens,
                "baseline_sampling_ms": per_token * t.get("plain:sample", 0.0),
                "constrained_sampling_ms": per_token * (t.get("json:sample", 0.0) + t.get("json:accept", 0.0)),
                "grammar_ms": per_token * (t.get("json:fill", 0.0) + t.get("json:accept", 0.0))})
    finally:
        engine.grammars.matcher = real_matcher  # type: ignore[method-assign]
        engine.sampler.sample = real_sample  # type: ignore[method-assign]
    cells = [[r["batch"], r["tokens"], f"{r['baseline_ms']:.1f}", f"{r['constrained_ms']:.1f}",
              f"{r['baseline_sampling_ms']:.3f}", f"{r['constrained_sampling_ms']:.3f}",
              f"{r['constrained_sampling_ms'] - r['baseline_sampling_ms']:+.3f}", f"{r['grammar_ms']:.3f}"]
             for r in rows]
    text = table(["batch", "tokens", "wall ms/token, plain", "wall ms/token, JSON schema",
                  "sampling ms/token, plain", "sampling ms/token, JSON schema", "constraint cost ms/token",
                  "of which grammar (mask + accept)"], cells)
    return rows, text


def run_structured(args: Any) -> int:
    from kvserve.bench import plots
    from kvserve.bench.common import write_plot
    from kvserve.model.loader import load_model
    from kvserve.options import engine_options

    loaded = load_model(args.model)
    llm = LLM(loaded=loaded, **engine_options(args))
    first_compile = compile_ms(llm)   # includes llguidance's one-time tokenizer build
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows, text = run(llm, sizes, args.max_tokens, args.repeats)
    print(f"JSON-schema constraint cost, {loaded.source}, device {llm.engine.device}, dtype {llm.engine.dtype}, "
          f"median of {args.repeats}")
    print(text)
    again = compile_ms(llm)
    print(f"\ncompile a new schema: {again:.1f} ms (first one, with the tokenizer build: {first_compile:.0f} ms)")
    write_plot(args.plot, lambda path: plots.plot_structured(rows, path))
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "structured", "rows": rows, "compile_ms": again,
                                               "first_compile_ms": first_compile}, indent=2))
    return 0


def add_structured_parser(bsub: Any, common: Any) -> None:
    s = bsub.add_parser("structured", parents=[common],
                        help="per-token cost of a JSON-schema constraint vs unconstrained decoding")
    s.add_argument("--batch-sizes", default="1,8")
    s.add_argument("--max-tokens", type=int, default=160, help="cap per answer (answers end when the JSON does)")
    s.add_argument("--repeats", type=int, default=3)
    s.set_defaults(run=run_structured)
