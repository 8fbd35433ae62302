"""Proposers that draft with a model: ``self`` (the served model, some layers left out, over its
own KV cache) and ``draft`` (a smaller model with the same vocabulary, over a cache of its own).

Both draft greedily, k tokens in k passes batched over the drafting requests; a draft is then
a function of the sequence, so speculative sampling keeps the target's distribution exactly as
with prompt lookup (kvserve/speculative/speculator.py). They run after the step is scheduled, once
each drafting request's chunk has its slots:

    chunk      [ t  d1 d2 d3 ]             positions n .. n + 3 (t: the last token, not computed)
    pass 1       t  -> d1                  writes t's keys and values at n
    pass 2          d1 -> d2               writes d1's at n + 1
    pass 3             d2 -> d3            writes d2's at n + 2
    the step     [ t  d1 d2 d3 ]           the target writes all four again, then attends

``self`` writes its rows into the chunk's own slots of the target's cache, which the
verifying step overwrites (every layer writes a step's rows before it reads them), so the
target never reads a draft's keys; the draft reads the target's exact keys and values of
every earlier position, in the layers it runs. ``draft`` keeps its own paged cache: per
request the tokens whose keys it holds (the longest run agreeing with the request's tokens is
valid; the rest is overwritten), so it computes only what it has not seen (the prompt once,
then the one or two tokens a step accepted past its drafts).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence

import torch

from kvserve.attention.backends import AttentionBackend
from kvserve.attention.batch import BatchBuilder
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import Decoder
from kvserve.request import Request
from kvserve.speculative.cost import FixedCosts, StepCosts
from kvserve.speculative.proposers import Proposer


class TokenPass:
    """Forward passes over given tokens at given positions of sequences held in a paged cache,
    outside the scheduler: a drafting model's steps (kvserve/speculative/drafters.py). Each row of a
    pass is (block ids, first position, tokens); the tokens' keys and values are written to
    their slots, and the pass gives the logits after each row's last token."""

    def __init__(self, model: Decoder, cache: KVStorage, backend: AttentionBackend,
                 layers: Sequence[int] | None = None) -> None:
        """``layers``: the model's layers a pass runs (default: all)."""
        self.model, self.cache, self.backend = model, cache, backend
        self.layers = None if layers is None else list(layers)

    def logits(self, rows: Sequence[tuple[list[int], int, Sequence[int]]]) -> torch.Tensor:
        """[len(rows), vocab] float32 on the model's device."""
        builder = BatchBuilder(self.cache, self.backend, self.model.device)
        last: list[int] = []
        for block_ids, start, tokens in rows:
            # every row counts as drafted: a block a pass fills keeps its residual row (a quantized
            # served cache: kv/storage/base.py), so the verifying step writes and encodes it again
            builder.add_tokens(block_ids, start, tokens, len(tokens))
            last.append(len(builder.input_ids) - 1)
        ids, pos, meta = builder.build()
        hidden = self.model.forward(ids, pos, self.cache, meta, self.layers)
        self.cache.finish_step(meta.write)
        return self.model.compute_logits(hidden[torch.tensor(last, dtype=torch.long, device=hidden.device)])


class ModelProposer(Proposer):
    """Drafts with a model, in passes (``pass_``) measured as they run (``costs``: seconds of a
    pass of n rows, the cost model's ``d(n)``)."""

    runs_pass = True

    def __init__(self, pass_: TokenPass, prior_base_s: float, prior_row_s: float) -> None:
        self.pass_ = pass_
        self.costs: StepCosts = StepCosts(prior_base_s, prior_row_s)

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        """Placeholders for the tokens ``draft`` will make (``room``'s count of them)."""
        return [request.all_token_ids[-1]] * self.room(request, num_tokens)

    def room(self, request: Request, num_tokens: int) -> int:
        """How many of ``num_tokens`` drafted tokens this proposer can make for ``request`` this
        step (it may reserve what they need); called before scheduling."""
        return num_tokens

    @abstractmethod
    def draft(self, entries: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Exactly ``k`` greedy tokens after each ``request.all_token_ids`` for ``(request, k)``;
        called once the step is scheduled (each request's chunk holds its slots)."""

    def pass_seconds(self, num_rows: int) -> float:
        return self.costs.step_s(num_rows)

    def always_draft(self) -> None:
        self.costs = FixedCosts(0.0, 0.0)

    def _passes(self, first_rows: list[tuple[list[int], int, list[int]]],
                entries: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """k passes: the first over ``first_rows`` (one per entry, each ending at the request's last
        token), then one token per request still drafting, each pass's argmax fed to the next."""
        drafts: list[list[int]] = [[] for _ in entries]
        rows = first_rows
        live = list(range(len(entries)))
        while live:
            start = time.perf_counter()
            tokens = self.pass_.logits(rows).argmax(dim=-1).tolist()
            num_tokens = sum(len(fed) for _, _, fed in rows)
            if num_tokens <= 2 * len(rows):     # a pass that catches up on a prompt is no draft pass
                self.costs.observe(num_tokens, time.perf_counter() - start)
            for i, token in zip(live, tokens):
                drafts[i].append(token)
            next_rows, next_live = [], []
            for row, i, token in zip(rows, live, tokens):
                k = entries[i][1]
                if len(drafts[i]) < k:
                    block_ids, start_pos, fed = row
                    next_rows.append((block_ids, start_pos + len(fed), [token]))
                    next_live.append(i)
            rows, live = next_rows, next_live
        return drafts


class SelfProposer(ModelProposer):
    """The served model drafts over its own KV cache (the module docstring), running the layers
    ``pass_`` names with the weights it holds (the served ones, or a cheaper format of them)."""

    name = "self"

    def __init__(self, pass_: TokenPass, kv: KVCacheManager, prior_base_s: float, prior_row_s: float) -> None:
        super().__init__(pass_, prior_base_s, prior_row_s)
        self.kv = kv

    def draft(self, entries: Sequence[tuple[Request, int]]) -> list[list[int]]:
        rows = [(self.kv.block_ids(req.request_id), req.num_tokens - 1, [req.all_token_ids[-1]]) for req, _ in entries]
        return self._passes(rows, entries)


class _Sequence:
    """What the draft cache holds for one request: its blocks and the tokens whose keys and
    values are written there, position by position."""

    __slots__ = ("block_ids", "tokens")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.tokens: list[int] = []


class DraftModelProposer(ModelProposer):
    """A separate model drafts over a paged cache of its own (``pass_``'s storage, ``num_blocks``
    blocks of ``block_size``). A request whose sequence the cache cannot take does not draft."""

    name = "draft"

    def __init__(self, pass_: TokenPass, num_blocks: int, block_size: int, max_positions: int,
                 prior_base_s: float, prior_row_s: float) -> None:
        super().__init__(pass_, prior_base_s, prior_row_s)
        self.block_size = block_size
        self.max_positions = max_positions
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[str, _Sequence] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def room(self, request: Request, num_tokens: int) -> int:
        # the draft writes every known token and all drafts but the last
        need_positions = request.num_tokens + num_tokens - 1
        if need_positions > self.max_positions:
            num_tokens = self.max_positions - request.num_tokens + 1
            need_positions = self.max_positions
        if num_tokens < 1:
            return 0
        seq = self._seqs.setdefault(request.request_id, _Sequence())
        need_blocks = -(-need_positions // self.block_size) - len(seq.block_ids)
        if need_blocks > len(self._free):
            return 0
        for _ in range(need_blocks):
            seq.block_ids.append(self._free.pop())
        return num_tokens

    def draft(self, entries: Sequence[tuple[Request, int]]) -> list[list[int]]:
        rows: list[tuple[list[int], int, list[int]]] = []
        for req, _ in entries:
            seq = self._seqs[req.request_id]
            ids = req.all_token_ids
            valid = _common_prefix(seq.tokens, ids, len(ids) - 1)
            rows.append((seq.block_ids, valid, list(ids[valid:])))
            seq.tokens[valid:] = ids[valid:]
        drafts = self._passes(rows, entries)
        for (req, _), draft in zip(entries, drafts):
            self._seqs[req.request_id].tokens.extend(draft[:-1])     # the last draft is never fed
        return drafts

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.block_ids))

    def check_integrity(self) -> None:
        held = [b for s in self._seqs.values() for b in s.block_ids]
        assert len(held) == len(set(held)) and not set(held) & set(self._free), "a draft block is held twice"
        assert len(held) + len(self._free) == self.pass_.cache.num_blocks, "a draft block was lost"
        for rid, s in self._seqs.items():
            assert len(s.tokens) <= len(s.block_ids) * self.block_size, f"draft sequence {rid} outgrew its blocks"


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])

