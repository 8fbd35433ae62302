"""Proposers: each drafts the tokens likely to follow a running request's sequence.

A proposer is looked up by the ``method`` of the speculative config. ``ngram`` (prompt
lookup) needs no model: the last n tokens often occurred before (a quoted document, code
being edited, a repeated name), and what followed them then is the draft:

    sequence   ... a b c d e ... x a b c      last n=3 tokens: "a b c"
    match            ^^^^^                    its most recent earlier occurrence
    draft                  d e ...            the tokens after it (up to k)

n goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the longest n that matches wins,
at its most recent occurrence followed by k tokens (a run "x x x x" drafts "x x .."), else at
its most recent occurrence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence

from kvserve.request import Request


class Proposer(ABC):
    """Drafts tokens for running requests. Its capabilities tell the speculator how to use it:
    ``runs_pass``, whether it drafts in a pass of its own once the step is scheduled (``propose``
    then gives placeholders of the length it will draft, ``draft`` the tokens), and
    ``pass_seconds``, what such a pass costs (the cost model's ``d(n)``; 0 for a lookup)."""

    name: str
    runs_pass = False

    @abstractmethod
    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens to follow ``request.all_token_ids`` (empty: no guess); a
        proposer that ``runs_pass``: that many placeholders, the tokens drafted by ``draft``."""

    def draft(self, entries: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Exactly ``k`` tokens after each ``request.all_token_ids`` for ``(request, k)``, once the
        step is scheduled (a proposer that ``runs_pass``)."""
        raise NotImplementedError(f"the {self.name} proposer drafts in propose, not in a pass")

    def pass_seconds(self, num_rows: int) -> float:
        """Seconds of a drafting pass over ``num_rows`` rows (0: the proposer runs no pass)."""
        return 0.0

    def always_draft(self) -> None:
        """Take drafting passes as free, so the cost model never backs off for them (measurements)."""

    def forget(self, request_id: str) -> None:
        """Drop what the proposer keeps for a finished request (nothing by default)."""

    def clear_history(self) -> None:
        """Drop what was learnt from finished requests, so that a measurement starts cold."""

    def check_integrity(self) -> None:
        """Check what the proposer holds (a draft model's cache)."""


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, array[int]] = {}    # each request's ids as int32, appended to as it grows

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        tokens = self._tokens.setdefault(request.request_id, array("i"))
        ids = request.all_token_ids
        if len(ids) < len(tokens):          # the sequence was never shortened; a reused id starts over
            del tokens[:]
        tokens.extend(ids[len(tokens):])
        n_tokens, size = len(tokens), tokens.itemsize
        packed = tokens.tobytes()
        # an occurrence must end before the last token, so that at least one token follows it;
        # one that ends num_tokens before gives a whole draft
        whole_end, some_end = max(0, n_tokens - num_tokens) * size, (n_tokens - 1) * size
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = packed[(n_tokens - n) * size:]
            at = _rfind_aligned(packed, suffix, size, whole_end)
            if at is None:
                at = _rfind_aligned(packed, suffix, size, some_end)
            if at is not None:
                start = at + n
                return tokens[start:start + num_tokens].tolist()
        return []

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def _rfind_aligned(haystack: bytes, needle: bytes, itemsize: int, end: int) -> int | None:
    """The last token index where ``needle`` occurs in ``haystack[:end]`` (both packed ids), or None."""
    while True:
        at = haystack.rfind(needle, 0, end)
        if at < 0:
            return None
        if at % itemsize == 0:
            return at // itemsize
        end = at + len(needle) - 1      # a match straddling two ids: look further left

