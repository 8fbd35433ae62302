"""Runs the three measurements on one backend and collects the results.

The workload (tokens of the perplexity text, chat prompts, passkey prompts) is
built once and shared by every backend, so all formats see identical inputs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.eval.agreement import CHAT_PROMPTS, agreement
from kvserve.eval.backends import EvalBackend, StorageCost
from kvserve.eval.passkey import FILLERS, PasskeyCase, build_cases, is_correct
from kvserve.eval.perplexity import LAYOUTS, PerplexityResult, perplexity
from kvserve.model.tokenizer import Tokenizer

TASKS = ("ppl", "agree", "passkey")
Log = Callable[[str], None]


@dataclass(frozen=True)
class EvalSettings:
    ppl_tokens: int = 2048          # the first N tokens of the text
    window: int = 1024
    stride: int = 512
    ppl_layout: str = "sliding"     # or "halves" (llama-perplexity's: kvserve/eval/perplexity.py)
    chunk: int = 64                 # tokens per forward / per engine step for every prompt
    num_prompts: int = 8
    agree_tokens: int = 32
    passkey_lengths: tuple[int, ...] = (1024, 2048, 4096)
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_trials: int = 1
    passkey_filler: str = "repeat"
    passkey_reuse: bool = True      # serve shared prompt prefixes from the prefix cache (exact)
    answer_tokens: int = 12         # greedy tokens generated for a passkey answer
    context_tokens: int = 1024      # storage is reported for sequences of about this length
    seed: int = 0
    tasks: tuple[str, ...] = TASKS

    def __post_init__(self) -> None:
        for name in ("ppl_tokens", "window", "stride", "chunk", "num_prompts", "agree_tokens",
                     "passkey_trials", "answer_tokens", "context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.ppl_layout not in LAYOUTS:
            raise ValueError(f"perplexity layout must be one of {', '.join(LAYOUTS)}, got {self.ppl_layout!r}")
        if self.num_prompts > len(CHAT_PROMPTS):
            raise ValueError(f"at most {len(CHAT_PROMPTS)} chat prompts are built in, got {self.num_prompts}")
        if self.passkey_filler not in FILLERS:
            raise ValueError(f"passkey filler must be one of {FILLERS}, got {self.passkey_filler!r}")
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; choose from {', '.join(TASKS)}")


@dataclass(frozen=True)
class Workload:
    ppl_ids: list[int]
    chat_prompts: list[list[int]]
    passkey_cases: list[PasskeyCase]

    @classmethod
    def build(cls, tokenizer: Tokenizer, text: str, settings: EvalSettings) -> Workload:
        ids = tokenizer.encode_prompt(text)       # with the BOS the model's tokenizer asks for
        if len(ids) < settings.ppl_tokens:
            raise ValueError(f"the text has {len(ids)} tokens, fewer than --ppl-tokens {settings.ppl_tokens}")
        chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                 for p in CHAT_PROMPTS[:settings.num_prompts]]
        cases = build_cases(tokenizer.encode, settings.passkey_lengths, settings.passkey_depths, settings.seed,
                            settings.passkey_filler, text, settings.passkey_trials, align=settings.chunk)
        return cls(ids[:settings.ppl_tokens], chats, cases)


@dataclass
class FormatResult:
    name: str
    engine: str                     # "kvserve" or "transformers"
    storage: StorageCost
    ppl: PerplexityResult | None = None
    agreement: float | None = None
    passkey: dict[int, tuple[int, int]] = field(default_factory=dict)   # length -> (correct, total)
    seconds: float = 0.0

    @property
    def passkey_total(self) -> tuple[int, int] | None:
        if not self.passkey:
            return None
        return sum(c for c, _ in self.passkey.values()), sum(t for _, t in self.passkey.values())


def stderr_log(message: str) -> None:
    print(f"[eval {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def greedy_all(backend: EvalBackend, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    return [backend.greedy(p, max_tokens) for p in prompts]


def evaluate(backend: EvalBackend, engine: str, work: Workload, settings: EvalSettings,
             reference: Sequence[list[int]] | None, tasks: Sequence[str], log: Log = stderr_log
             ) -> tuple[FormatResult, list[list[int]] | None]:
    """The measurements in ``tasks`` on one backend; also its greedy chat outputs
    (when "agree" ran), so a reference backend's outputs can serve the others."""
    t0 = time.perf_counter()
    result = FormatResult(backend.name, engine, backend.storage(settings.context_tokens))
    outputs = None
    if "ppl" in tasks:
        def progress(done: int, total: int) -> None:
            log(f"{backend.name}: perplexity window {done}/{total} ({time.perf_counter() - t0:.0f} s)")
        result.ppl = perplexity(backend.prompt_logprobs, work.ppl_ids, settings.window, settings.stride, progress,
                                settings.ppl_layout)
        log(f"{backend.name}: perplexity {result.ppl.perplexity:.4f}")
    if "agree" in tasks:
        outputs = greedy_all(backend, work.chat_prompts, settings.agree_tokens)
        if reference is not None:
            result.agreement = agreement(outputs, reference, settings.agree_tokens)
            log(f"{backend.name}: greedy agreement {result.agreement:.3f}")
    if "passkey" in tasks:
        # latest needle first: each later prompt shares its prefix up to its needle
        # with one already computed (see passkey.py)
        order = sorted(work.passkey_cases, key=lambda c: -c.needle_start)
        starts = {c.needle_start for c in order} if settings.passkey_reuse else set()
        for i, case in enumerate(order):
            shared = case.needle_start if settings.passkey_reuse else 0
            keep = {p for p in starts if p <= case.needle_start}    # what later (shorter) needles share
            answer = backend.decode(backend.greedy(case.token_ids, settings.answer_tokens, shared, keep))
            ok = is_correct(case, answer)
            correct, total = result.passkey.get(case.num_filler_tokens, (0, 0))
            result.passkey[case.num_filler_tokens] = (correct + ok, total + 1)
            log(f"{backend.name}: passkey {i + 1}/{len(order)} {case.num_filler_tokens} tokens, "
                f"depth {case.depth:.2f}: {'ok' if ok else 'MISS'} {answer.strip()[:40]!r}")
    result.seconds = time.perf_counter() - t0
    log(f"{backend.name}: done in {result.seconds:.0f} s")
    return result, outputs
