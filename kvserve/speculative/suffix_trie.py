"""The counting index of suffix decoding (kvserve/speculative/suffix.py): a trie of the substrings
of up to ``max_depth`` tokens of the sequences added, each node counting its path's occurrences.

    sequence "a b a b c", max_depth 3
    root ─┬ a 2 ── b 2 ─┬ a 1        "a b a" once
          │             └ c 1        "a b c" once
          ├ b 2 ─┬ a 1 ── b 1
          │      └ c 1
          └ c 1

A sequence is counted as it grows (``extend``: the suffixes ending at its new token, one child
step each from the nodes of the suffixes before it), or at once (``add``), and uncounted
(``remove``) by walking each of its substrings again.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

ROOT = 0


class SuffixTrie:
    """Counts of the substrings of up to ``max_depth`` tokens of the sequences added.

    Node ``v``'s path is a substring; ``count[v]`` how many times it occurs (by start position),
    ``stamp[v]`` when it last occurred (ties go to the most recent). Children: the first one in
    ``first_token`` / ``first_child`` (0: none; the root is nobody's child), the others in a dict
    (most nodes deep in the trie have one child, so packed arrays hold them at ~30 bytes a node).
    Invariant: a node's count is at least the sum of its children's (every occurrence of a
    path extended by a token is an occurrence of the path)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._count = array("i", [0])
        self._stamp = array("q", [0])           # the global trie's clock runs on past 2**31
        self._first_token = array("i", [0])
        self._first_child = array("i", [0])
        self._more: list[dict[int, int] | None] = [None]
        self._num_slots = 1                     # nodes ever made; the arrays hold more, zeroed, grown by doubling
        self._free: list[int] = []              # nodes given back, zeroed

    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root included."""
        return self._num_slots - len(self._free)

    def extend(self, open_nodes: list[int], token: int, stamp: int) -> list[int]:
        """Count the sequence's suffixes that end at its new last ``token``: ``open_nodes`` are
        the nodes of the suffixes before it shorter than ``max_depth`` (shortest first, as
        returned by the last call; [] for a new sequence); returns the new ones."""
        # the hot loop of indexing (a prompt: max_depth children per token), written out
        count, stamps, first_token, first_child, more_of = (self._count, self._stamp, self._first_token,
                                                            self._first_child, self._more)
        nodes = []
        for v in (ROOT, *open_nodes):
            c = first_child[v]
            if not c or first_token[v] != token:
                more = more_of[v]
                found = more.get(token) if more else None
                c = found if found is not None else self._new_child(v, token)
            count[c] += 1
            stamps[c] = stamp
            nodes.append(c)
        del nodes[self.max_depth - 1:]      # a path of max_depth tokens is never extended
        return nodes

    def add(self, tokens: Sequence[int], first_stamp: int) -> None:
        """Count the substrings of ``tokens``, the i-th token stamped ``first_stamp + i``."""
        nodes: list[int] = []
        for i, t in enumerate(tokens):
            nodes = self.extend(nodes, t, first_stamp + i)

    def remove(self, tokens: Sequence[int]) -> None:
        """Uncount the substrings of ``tokens``, added before: paths whose count falls to 0 go."""
        n = len(tokens)
        for start in range(n):
            v = ROOT
            for t in tokens[start:min(n, start + self.max_depth)]:
                v = self._child_uncounted(v, t)

    def find(self, path: Sequence[int]) -> int | None:
        """The node of ``path``, if it occurred."""
        v = ROOT
        for t in path:
            c = self._child(v, t)
            if c is None:
                return None
            v = c
        return v

    def longest_match(self, ids: Sequence[int], min_len: int, max_len: int) -> int:
        """The most last tokens of ``ids`` (between ``min_len`` and ``max_len``) that occurred with a
        token after them; 0 if none. (If the last n did, the last n - 1 did too: a binary search.)"""
        lo, hi = min_len - 1, min(max_len, len(ids))
        if lo >= hi:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            v = self.find(ids[len(ids) - mid:])
            if v is not None and self.has_children(v):
                lo = mid
            else:
                hi = mid - 1
        return lo if lo >= min_len else 0

    def has_children(self, v: int) -> bool:
        return self._first_child[v] != 0

    def continuation(self, v: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation of node ``v``'s path, up to ``max_tokens`` tokens, while
        each token's share of its siblings' counts is at least ``min_prob``; and its expected
        accepted tokens (p1 + p1 p2 + ...)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and self._first_child[v]:
            token, child, share = self._best_child(v)
            if share < min_prob:
                break
            tokens.append(token)
            prob *= share
            score += prob
            v = child
        return tokens, score

    def _best_child(self, v: int) -> tuple[int, int, float]:
        """The child of ``v`` counted most (the most recent of a tie): its token, node and share."""
        count, stamp = self._count, self._stamp
        best_token, best = self._first_token[v], self._first_child[v]
        total = count[best]
        more = self._more[v]
        if more:
            for t, c in more.items():
                total += count[c]
                if (count[c], stamp[c]) > (count[best], stamp[best]):
                    best_token, best = t, c
        return best_token, best, count[best] / total

    def _child(self, v: int, token: int) -> int | None:
        if self._first_token[v] == token and self._first_child[v]:
            return self._first_child[v]
        more = self._more[v]
        return more.get(token) if more else None

    def _new_child(self, v: int, token: int) -> int:
        """A new child of ``v`` by ``token`` (count 0)."""
        c = self._new_node()
        if not self._first_child[v]:
            self._first_token[v], self._first_child[v] = token, c
        else:
            more = self._more[v]
            if more is None:
                more = self._more[v] = {}
            more[token] = c
        return c

    def _child_uncounted(self, v: int, token: int) -> int:
        c = self._child(v, token)
        if c is None:
            raise AssertionError(f"suffix trie: removing a path that was never added (token {token})")
        self._count[c] -= 1
        if self._count[c] == 0:
            self._unlink(v, token, c)
        return c

    def _new_node(self) -> int:
        if self._free:
            return self._free.pop()
        v = self._num_slots
        if v == len(self._count):
            for a in (self._count, self._stamp, self._first_token, self._first_child):
                a.frombytes(bytes(a.itemsize * v))      # v zeros
            self._more.extend([None] * v)
        self._num_slots = v + 1
        return v

    def _unlink(self, v: int, token: int, c: int) -> None:
        """Drop child ``c`` of ``v`` (its count is 0, so are its children's: the walk that took it
        to 0 unlinks them next) and free its node."""
        more = self._more[v]
        if self._first_child[v] == c:
            if more:
                self._first_token[v], self._first_child[v] = more.popitem()
            else:
                self._first_token[v] = self._first_child[v] = 0
        elif more is not None:
            del more[token]
        if more is not None and not more:
            self._more[v] = None
        # zeroed: its count (0) and stamp now, its first child when the walk unlinks that next
        self._stamp[c] = 0
        self._free.append(c)

    def check_integrity(self) -> None:
        """Every node in use has a positive count, at least its children's sum; nodes in use are
        those reachable from the root."""
        count = self._count
        seen, stack = 1, [ROOT]
        while stack:
            v = stack.pop()
            children = self._children(v)
            if v != ROOT and sum(count[c] for c in children) > count[v]:
                raise AssertionError(f"suffix trie: node {v} counts {count[v]}, less than its children")
            for c in children:
                if count[c] <= 0:
                    raise AssertionError(f"suffix trie: node {c} is linked with count {count[c]}")
                seen += 1
                stack.append(c)
        if seen != self.num_nodes:
            raise AssertionError(f"suffix trie: {seen} nodes reachable, {self.num_nodes} in use")
        for v in self._free:
            if count[v] or self._stamp[v] or self._first_token[v] or self._first_child[v] or self._more[v] is not None:
                raise AssertionError(f"suffix trie: free node {v} is not zeroed")

    def _children(self, v: int) -> list[int]:
        out = [self._first_child[v]] if self._first_child[v] else []
        more = self._more[v]
        return out + list(more.values()) if more else out
