"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from counts of what followed.

Two indexes count every substring of up to ``max_depth`` tokens (kvserve/speculative/suffix_trie.py):
one per running request, over its prompt and output, extended as the sequence grows, and one
over the outputs of finished requests (fed by ``forget``; the oldest outputs dropped past
``max_global_tokens``). To draft k tokens, each index is asked for the longest suffix of the
sequence (``min_match`` .. ``max_depth - k`` tokens, so a whole draft fits below it) that occurred
with a token after it; from its node the draft follows the most counted child (the most recent
of a tie) while that child's share of its siblings' counts is at least ``min_prob``:

    sequence    ... def area ( self )                  the last tokens
    match       "area ( self )": ":" 3 times, "->" once
    draft       ":" (p 3/4), then ":"'s most counted child (p ...), ...   up to k, while p >= min_prob

A draft that falls short of k (the index ran out, or no child was likely enough) is compared
with those of shorter matches, which have more below them. Each candidate scores its expected
accepted tokens, p1 + p1 p2 + p1 p2 p3 + ... (a run ends at the first rejection); the request's
own index and the outputs' each give their best, and the higher score drafts (a tie: the
request's own).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvserve.request import Request
from kvserve.speculative.proposers import Proposer
from kvserve.speculative.suffix_trie import SuffixTrie


@dataclass
class _Indexed:
    """A running request's sequence as far as its trie counts it."""

    trie: SuffixTrie
    num_prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    open_nodes: list[int] = field(default_factory=list)


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, max_depth: int, min_match: int, min_prob: float, max_global_tokens: int) -> None:
        """``max_depth``: the longest substring counted (a match and the draft after it together);
        ``min_match``: the fewest last tokens matched; ``min_prob``: a drafted token's least share
        of what followed there; ``max_global_tokens``: the finished outputs' index holds at most so
        many tokens, the oldest outputs dropped first."""
        self.max_depth = max_depth
        self.min_match = min_match
        self.min_prob = min_prob
        self.max_global_tokens = max_global_tokens
        self._requests: dict[str, _Indexed] = {}
        self._global = SuffixTrie(max_depth)
        self._outputs: deque[list[int]] = deque()    # what the global trie holds, oldest first
        self._num_global_tokens = 0
        self._stamp = 0                              # the global trie's clock: tokens ever added

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        ids = request.all_token_ids
        indexed = self._index(request)
        max_match = self.max_depth - num_tokens      # room for a whole draft below the match
        best: tuple[list[int], float] = ([], 0.0)
        for trie in (indexed.trie, self._global):
            draft = self._draft(trie, ids, num_tokens, max_match)
            if draft[1] > best[1]:
                best = draft
        return best[0]

    def _draft(self, trie: SuffixTrie, ids: list[int], num_tokens: int, max_match: int) -> tuple[list[int], float]:
        """The draft from the longest match; while a draft falls short of ``num_tokens``, the
        shorter matches' too (a shorter match has more below it): the best by expected accepted tokens."""
        length = trie.longest_match(ids, self.min_match, max_match)
        best: tuple[list[int], float] = ([], 0.0)
        while length >= self.min_match:
            node = trie.find(ids[len(ids) - length:])
            assert node is not None
            draft = trie.continuation(node, num_tokens, self.min_prob)
            if draft[1] > best[1]:
                best = draft
            if len(draft[0]) == num_tokens:
                break
            length -= 1
        return best

    def _index(self, request: Request) -> _Indexed:
        """The request's index, extended by the tokens it has not counted yet."""
        ids = request.all_token_ids
        indexed = self._requests.get(request.request_id)
        seen = indexed.tokens if indexed is not None else []
        # a sequence only grows: one that is shorter or differs at its last counted token is a
        # reused id, which starts over
        if indexed is None or len(ids) < len(seen) or (seen and ids[len(seen) - 1] != seen[-1]):
            indexed = self._requests[request.request_id] = _Indexed(SuffixTrie(self.max_depth),
                                                                    request.num_prompt_tokens)
        trie, nodes = indexed.trie, indexed.open_nodes
        for position in range(len(indexed.tokens), len(ids)):
            nodes = trie.extend(nodes, ids[position], position)
        indexed.open_nodes = nodes
        indexed.tokens.extend(ids[len(indexed.tokens):])
        return indexed

    def forget(self, request_id: str) -> None:
        """The request's output (as far as it was seen) joins the finished outputs' index."""
        indexed = self._requests.pop(request_id, None)
        if indexed is None:
            return
        output = indexed.tokens[indexed.num_prompt_tokens:]
        output = output[max(0, len(output) - self.max_global_tokens):]
        if not output:
            return
        self._global.add(output, self._stamp)
        self._stamp += len(output)
        self._outputs.append(output)
        self._num_global_tokens += len(output)
        while self._num_global_tokens > self.max_global_tokens:
            oldest = self._outputs.popleft()
            self._global.remove(oldest)
            self._num_global_tokens -= len(oldest)

    def clear_history(self) -> None:
        self._global = SuffixTrie(self.max_depth)
        self._outputs.clear()
        self._num_global_tokens = 0

    @property
    def num_global_tokens(self) -> int:
        return self._num_global_tokens

    def check_integrity(self) -> None:
        if self._num_global_tokens != sum(len(o) for o in self._outputs) or \
                self._num_global_tokens > self.max_global_tokens:
            raise AssertionError(f"suffix proposer: {self._num_global_tokens} global tokens counted, "
                                 f"{sum(len(o) for o in self._outputs)} held, cap {self.max_global_tokens}")
        self._global.check_integrity()
        for indexed in self._requests.values():
            indexed.trie.check_integrity()
