"""Perplexity over a token sequence with sliding windows.

The first ``num_tokens`` tokens are covered by windows of ``window`` tokens that
start every ``stride`` tokens. Each window is scored only past its overlap with
the previous one, so every token 1 .. n-1 is scored exactly once, with at least
``window - stride`` tokens of context (except in the first window):

    tokens   0 ............................................ n
    window 0 [0, W)        scores 1 .. W-1
    window 1     [S, S+W)  scores W .. S+W-1      (context >= W - S)
    window 2         [2S, 2S+W) scores S+W .. 2S+W-1
    ...      the last window ends at n

Inside a window the backend feeds the tokens in chunks (see ``EvalBackend``),
so every chunk attends to the compressed cache of the chunks before it.

The ``halves`` layout is llama.cpp's ``llama-perplexity`` default, for comparing with it on
the same text: windows of W tokens back to back (the tokens past the last whole window are
left out), each scoring the tokens of its second half after the first (W/2 + 1 .. W-1 of the
window: every scored token has at least W/2 tokens of context):

    window 0 [0, W)     scores W/2+1 .. W-1
    window 1 [W, 2W)    scores W + W/2+1 .. 2W-1
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Window(NamedTuple):
    begin: int        # first token of the window
    end: int          # one past the last
    score_from: int   # first token scored in this window (begin < score_from <= end)


class PerplexityResult(NamedTuple):
    nll_sum: float    # sum of -log p over the scored tokens (nats)
    num_scored: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows covering tokens [0, num_tokens); each token but the first is scored once."""
    if num_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window - 1] = [1, {window - 1}] so windows overlap, got {stride}")
    windows: list[Window] = []
    scored_to = 1          # tokens < scored_to are scored (token 0 never is: it has no context)
    begin = 0
    while True:
        end = min(begin + window, num_tokens)
        windows.append(Window(begin, end, scored_to))
        scored_to = end
        if end == num_tokens:
            return windows
        begin += stride


def halves_windows(num_tokens: int, window: int) -> list[Window]:
    """``llama-perplexity``'s chunks: whole windows back to back, each scored on its second half."""
    if window < 4:
        raise ValueError(f"window must be at least 4 tokens, got {window}")
    if num_tokens < window:
        raise ValueError(f"the halves layout needs at least one whole window of {window} tokens, got {num_tokens}")
    return [Window(begin, begin + window, begin + window // 2 + 1)
            for begin in range(0, num_tokens - window + 1, window)]


LAYOUTS = ("sliding", "halves")


def windows_of(layout: str, num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows of ``layout`` (``halves`` takes no stride)."""
    if layout == "sliding":
        return sliding_windows(num_tokens, window, stride)
    if layout == "halves":
        return halves_windows(num_tokens, window)
    raise ValueError(f"unknown perplexity layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def describe_layout(layout: str, window: int, stride: int) -> str:
    """How a report names the windows."""
    if layout == "halves":
        return f"windows of {window} back to back, each scored on its second half (llama-perplexity's)"
    return f"window {window}, stride {stride}"


# Scores a window: token ids -> log p(ids[i] | ids[:i]) for i = 1 .. len(ids) - 1.
ScoreFn = Callable[[Sequence[int]], list[float]]


def perplexity(score: ScoreFn, token_ids: Sequence[int], window: int, stride: int,
               progress: Callable[[int, int], None] | None = None, layout: str = "sliding") -> PerplexityResult:
    """exp(mean NLL) of the tokens ``layout``'s windows score (``sliding``: ``token_ids[1:]``),
    window by window with ``score``.

    ``progress(done, total)`` is called after each window.
    """
    windows = windows_of(layout, len(token_ids), window, stride)
    nll_sum = 0.0
    num_scored = 0
    for i, w in enumerate(windows):
        logprobs = score(token_ids[w.begin:w.end])
        expected = w.end - w.begin - 1
        if len(logprobs) != expected:
            raise RuntimeError(f"the scorer returned {len(logprobs)} logprobs for a window of "
                               f"{w.end - w.begin} tokens (expected {expected})")
        # logprobs[j] belongs to token begin + 1 + j
        kept = logprobs[w.score_from - w.begin - 1:]
        nll_sum -= sum(kept)
        num_scored += len(kept)
        if progress is not None:
            progress(i + 1, len(windows))
    return PerplexityResult(nll_sum, num_scored)
