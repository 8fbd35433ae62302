"""Passkey retrieval: a five-digit number hidden at a depth of a long filler text.

The prompt (Mohtashami & Jaggi 2023, "Landmark Attention") is

    HEAD + filler[:cut] + NEEDLE + filler[cut:] + QUESTION

where the filler is exactly ``num_filler_tokens`` tokens, and the model continues
after "The pass key is". An answer is correct when the first number in its first
few greedy tokens is the key. Keys come from ``random.Random(seed)``, so every run
(and every format) gets the same prompts.

``cut`` is the position nearest to ``depth * num_filler_tokens`` at which the needle
starts on a multiple of ``align`` tokens of the prompt (the prefill chunk). Prompts
whose needles sit at the same or a later position share ``needle_start`` tokens, so
a prefix cache can serve them, and since a prefill chunk boundary falls exactly there,
a hit computes the same chunks as a cold run. The cut may fall inside a sentence.

Fillers: ``repeat`` is the standard "The grass is green. ..." group, repeated;
``text`` is consecutive sentences of the evaluation text (botchan.txt), much harder
for small models because the needle no longer stands out.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.")
REPEAT_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
FILLERS = ("repeat", "text")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class PasskeyCase:
    num_filler_tokens: int   # the haystack length asked for (1024, 2048, ...)
    depth: float             # 0.0 .. 1.0
    key: int
    token_ids: list[int]
    needle_start: int        # index in token_ids of the needle's first token (a multiple of align)
    needle_len: int


def filler_sentences(kind: str, text: str | None = None) -> list[str]:
    """Filler sentences, each with its leading space."""
    if kind == "repeat":
        return [REPEAT_FILLER]
    if kind == "text":
        if not text:
            raise ValueError("the 'text' filler needs an evaluation text")
        flat = re.sub(r"\s+", " ", text).strip()
        return [" " + s for s in re.split(r"(?<=[.!?]) (?=[A-Z\"'])", flat) if s]
    raise ValueError(f"unknown filler {kind!r}; choose one of {', '.join(FILLERS)}")


def build_filler(encode: Encode, sentences: Sequence[str], num_tokens: int) -> list[int]:
    """Exactly ``num_tokens`` tokens of the sentences, in order, cycling."""
    if num_tokens < 1:
        raise ValueError(f"filler length must be positive, got {num_tokens}")
    encoded = [ids for ids in (encode(s) for s in sentences) if ids]
    if not encoded:
        raise ValueError("the filler sentences encode to no tokens")
    ids: list[int] = []
    i = 0
    while len(ids) < num_tokens:
        ids.extend(encoded[i % len(encoded)])
        i += 1
    return ids[:num_tokens]


def needle_cut(num_head_tokens: int, num_filler_tokens: int, depth: float, align: int) -> int:
    """Filler tokens before the needle: nearest to depth * filler length such that the
    needle starts on a multiple of ``align``; within [0, filler length] when possible."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if align < 1:
        raise ValueError(f"align must be positive, got {align}")
    first = -num_head_tokens % align                       # smallest aligned cut >= 0
    if first > num_filler_tokens:
        raise ValueError(f"a filler of {num_filler_tokens} tokens is shorter than the {first} tokens "
                         f"needed to align the needle to {align}")
    steps = round((depth * num_filler_tokens - first) / align)
    last = (num_filler_tokens - first) // align
    return first + align * min(max(steps, 0), last)


def build_cases(encode: Encode, lengths: Sequence[int], depths: Sequence[float], seed: int = 0,
                filler: str = "repeat", text: str | None = None, trials: int = 1,
                align: int = 1) -> list[PasskeyCase]:
    """``trials`` cases (each with its own key) per length and depth, in that order."""
    rng = random.Random(seed)
    sentences = filler_sentences(filler, text)
    head, question = encode(HEAD), encode(QUESTION)
    cases = []
    for length in lengths:
        ids = build_filler(encode, sentences, length)
        for depth in depths:
            cut = needle_cut(len(head), length, depth, align)
            for _ in range(trials):
                key = rng.randrange(10000, 100000)
                needle = encode(NEEDLE.format(key=key))
                prompt = head + ids[:cut] + needle + ids[cut:] + question
                cases.append(PasskeyCase(length, depth, key, prompt, len(head) + cut, len(needle)))
    return cases


def parse_answer(text: str) -> int | None:
    """The first run of digits in a generated answer, or None."""
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


def is_correct(case: PasskeyCase, answer_text: str) -> bool:
    return parse_answer(answer_text) == case.key
