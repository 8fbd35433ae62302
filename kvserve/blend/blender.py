"""The engine's side of blending: a request whose prompt has segments gets its prompt's KV
by blending, then decodes like any other request. The blend chooses the rows to recompute
outside the batched step (between steps, a few layers per step); in the batch (``in_batch``,
the default) the engine's steps then compute them (``kvserve.request.BlendRows``), else the
whole blend runs here.

At its first admission (the engine calls, in order):

    choose(req, num_known)   store the segments not stored yet (computed standalone), find the
                             others (device, then tiers), and decide: blend only when loading
                             plus the partial recompute is estimated to beat a full prefill
    start(req, ...)          the exact prefix hit's KV (``num_known`` tokens) read back, the
                             segments' KV loaded and moved to their places: a ``BlendTask``
    task.advance(budget)     ``BlendJob``'s layers, ``budget`` token-layers at a time
    rows(task)               in the batch: the rows chosen, and the others' KV, for the steps
    finish(task)             else: the KV of every token after the hit written into the
                             request's blocks; returns the next-token logits

The request's blocks from its first segment on then hold KV that no exact computation
produced, so the KV manager never caches them under prefix keys (``KVCacheManager.mark_lossy``);
the full blocks before it (a system prompt, say) are exact and cached like any other. A
preempted blended request is recomputed in full, exactly, like any other.

Cost, in prefill-token equivalents (a token through every layer = 1):

    full   = n                                          n: tokens after the prefix hit
    blend  = computed + reused * (s / L + f * (1 - s / L)) + load_s * prefill_tokens_per_s    (deviation)
    blend  = (1 + r) * computed + reused * f + load_s * prefill_tokens_per_s                (query, query-segments)

with L layers, s = ``select_layer`` (layers below it run for every token), f the share of
the reused tokens recomputed (the blend fraction of the segments not recomputed whole, or
their sink tokens where they are more, plus the last ``last_segments`` segments' tokens),
``computed`` the tokens not reused (the query selections compute them twice: once to
choose, up to the layer read, ``r = (query_layer + 1) / L``, or every layer, ``r = 1``,
and once over the blend), ``load_s`` the tiers' estimate for the segment blocks they hold
(kv/tiering.py, measured figures) and the engine's measured prefill speed. Attention's
quadratic share is left out of both sides. A segment computed standalone for storing is paid
either way, so it counts as reused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.attention.backends import AttentionBackend
from kvserve.blend.blending import Blended, BlendJob, BlendPrompt, narrowing_fractions
from kvserve.blend.calibrated import resolve_selection
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import SegmentKV, compute_kv
from kvserve.blend.store import SegmentStore, read_tokens, write_tokens
from kvserve.config import QUERY_SELECTIONS, check_blend_selection
from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiering import Tiering
from kvserve.model.decoder import Decoder
from kvserve.request import BlendRows, BlendSpec, Request

log = logging.getLogger(__name__)


class Selection(NamedTuple):
    """How one prompt's recomputed tokens are picked (``Blender.how``)."""

    selection: str
    query_layer: int | None
    sink_tokens: int
    last_segments: int


@dataclass
class BlendStats:
    """Counters since the engine started (read by the metrics observer)."""

    num_blended: int = 0              # requests whose prompt was blended
    num_declined: int = 0             # requests with segments the cost model sent to a full prefill
    reused_tokens: int = 0            # prompt tokens whose KV came from a stored segment (selected included)
    recomputed_tokens: int = 0        # of those, recomputed from the select layer on
    computed_tokens: int = 0          # blended prompts' tokens computed in full (not known, not reused)
    stored_tokens: int = 0            # segment tokens computed standalone and stored


@dataclass(frozen=True)
class BlendPlan:
    """``choose``'s verdict to blend: the exact prefix hit's length and, per segment, its KV
    when ``choose`` just computed it standalone (None: found stored, or not reused); and how
    many leading tokens the blend computes exactly (the hit, and what precedes the first
    segment: no reused KV comes before them), the blocks the request may cache."""

    num_known: int
    fresh: tuple[SegmentKV | None, ...]
    num_exact: int


class BlendTask:
    """A request's blend under way: ``advance`` it until it answers True, then ``finish``."""

    def __init__(self, req: Request, job: BlendJob, block_ids: list[int], num_known: int) -> None:
        self.request, self.job, self.block_ids, self.num_known = req, job, block_ids, num_known
        self.result: Blended | BlendRows | None = None

    def advance(self, max_work: float) -> bool:
        """Run about ``max_work`` token-layers more (``BlendJob``; one layer at least); whether done."""
        if self.result is None:
            self.result = self.job.advance(max_work)
        return self.result is not None


@dataclass(frozen=True)
class BlendOutcome:
    logits: torch.Tensor              # [1, vocab] float32 on CPU: the prompt's next token
    num_reused_tokens: int
    num_recomputed_tokens: int
    num_computed_tokens: int


def blend_work(num_tokens: int, num_reused: int, fraction: float, select_layer: int, num_layers: int,
               selection: str = "deviation", num_sink_tokens: int = 0, query_layer: int | None = None,
               in_batch: bool = False, num_whole: int = 0, num_asking: int | None = None) -> float:
    """Prefill-token equivalents a blend computes for ``num_tokens`` tokens of which
    ``num_reused`` come from stored segments, ``num_sink_tokens`` of them always recomputed,
    and ``num_whole`` more (the last segments', ``blend_last_segments``), the fraction taken of
    the others (module docstring). ``in_batch`` (the rows computed by the steps): the deviation
    selections' rows also run again through the layers up to the last that chooses.
    ``num_asking``: the query selections' first pass's rows (the text before the first
    segment and the question, ``_Context.asking``; default: every token not reused)."""
    rest = num_reused - num_whole
    recomputed_at = lambda f: num_whole + min(rest, max(f * rest, num_sink_tokens))   # tokens recomputed at f
    recomputed = recomputed_at(fraction)
    computed = num_tokens - num_reused
    if selection in QUERY_SELECTIONS:    # the question computed twice (first up to the layer read)
        first = 1.0 if query_layer is None else (query_layer + 1) / num_layers
        return computed + first * (computed if num_asking is None else num_asking) + recomputed
    below = select_layer / num_layers
    fractions = narrowing_fractions(fraction, num_layers - select_layer) if selection == "narrowing" else (fraction,)
    again = (computed + recomputed) * (select_layer + len(fractions)) / num_layers if in_batch else 0.0
    # wider for the first layers of the narrowing
    wider = sum(recomputed_at(f) - recomputed for f in fractions[:-1]) / num_layers
    return computed + num_reused * below + recomputed * (1.0 - below) + wider + again


class Blender:
    def __init__(self, model: Decoder, storage: KVStorage, kv: KVCacheManager, pool: BlockPool, tiering: Tiering,
                 attention: AttentionBackend, select_layer: int = 1, use_cost_model: bool = True,
                 selection: str = "deviation",
                 sink_tokens: int = 0, query_layer: int | None = None, preamble: Sequence[int] = (),
                 in_batch: bool = False, last_segments: int = 0,
                 resolve: Callable[[str], tuple[str, int | None]] | None = None) -> None:
        """``attention``: the engine's backend, which the blends' passes attend through
        (``AttentionBackend.attend_dense``); ``use_cost_model`` False: blend whenever a segment's KV can be reused; ``selection``,
        ``sink_tokens``, ``query_layer`` and ``last_segments``: how the recomputed tokens are
        picked (``blend_prefill``), unless a prompt names its own (``BlendSpec``); ``resolve``: a
        prompt's selection name to the selection and query layer it runs with (the engine's
        ``calibrated.resolve_selection`` with its options and model; default: ``auto`` by
        ``query_layer`` alone);
        ``preamble``: the tokens every segment is computed after before it is stored
        (``compute_kv``; part of the segments' keys); ``in_batch``: the engine's steps compute
        the rows a blend chooses (``start``), as its cost model counts them."""
        if not 1 <= select_layer < model.config.num_layers:
            raise ValueError(f"blend_select_layer must be in 1..{model.config.num_layers - 1} for this model, "
                             f"got {select_layer}")
        check_blend_selection(selection, sink_tokens, last_segments)
        if query_layer is not None and not 0 <= query_layer < model.config.num_layers:
            raise ValueError(f"blend_query_layer must be in 0..{model.config.num_layers - 1} for this model, "
                             f"got {query_layer}")
        self.selection, self.sink_tokens, self.query_layer = selection, sink_tokens, query_layer
        self.last_segments = last_segments
        self._resolve = resolve or (lambda name: resolve_selection(name, query_layer, ""))
        self.in_batch = in_batch
        self.model = model
        self.attention = attention
        self.use_cost_model = use_cost_model
        self.storage = storage
        self.kv = kv
        self.tiering = tiering      # its load estimates and measured prefill speed, for the cost model
        self.rope = RopeTables(model.config)
        if len(preamble) >= model.config.max_position_embeddings:
            raise ValueError(f"the blend preamble has {len(preamble)} tokens, more than the model's "
                             f"{model.config.max_position_embeddings} positions leave a segment")
        self.segments = SegmentStore(kv, pool, storage, tiering, preamble)
        self.select_layer = select_layer
        self.stats = BlendStats()

    @property
    def num_layers(self) -> int:
        return self.model.config.num_layers

    def how(self, spec: BlendSpec) -> Selection:
        """How a prompt's recomputed tokens are picked: what its spec names, else the engine's."""
        selection, query_layer = ((self.selection, self.query_layer) if spec.selection is None
                                  else self._resolve(spec.selection))
        return Selection(selection, query_layer,
                         self.sink_tokens if spec.sink_tokens is None else spec.sink_tokens,
                         self.last_segments if spec.last_segments is None else spec.last_segments)

    def store(self, token_ids: list[int], salt: str = "") -> int:
        """Compute a segment standalone and store its full blocks unless the device or the
        tiers hold it already; returns the tokens stored (0 when stored, or shorter than a
        block). NoFreeBlocksError when the pool cannot hold it."""
        location = self.segments.locate(token_ids, salt)
        if location.num_full_blocks == 0 or location.num_blocks:
            return 0
        return self._put(self._compute(token_ids), salt)

    def _compute(self, token_ids: Sequence[int]) -> SegmentKV:
        """A segment as it is stored: computed standalone, after the preamble where there is one."""
        return compute_kv(self.model, token_ids, preamble=self.segments.preamble, rope=self.rope)

    def choose(self, req: Request, num_known: int) -> BlendPlan | None:
        """How to blend ``req`` (its first ``num_known`` tokens an exact prefix hit), or None
        when a full prefill is cheaper; the segments not stored anywhere are computed and
        stored first, whatever the verdict."""
        spec = _spec(req)
        how = self.how(spec)
        n = req.num_prompt_tokens - num_known
        load_s, num_reused, num_sinks, num_whole = 0.0, 0, 0, 0
        whole_from = len(spec.spans) - how.last_segments       # the first segment recomputed whole
        fresh: list[SegmentKV | None] = []
        for i, (start, length) in enumerate(spec.spans):
            segment = None
            if start + length > num_known:
                ids = req.prompt_token_ids[start:start + length]
                location = self.segments.locate(ids, req.cache_salt, req.tenant)
                if location.num_blocks == 0 and location.num_full_blocks:
                    segment = self._compute(ids)
                    self._put(segment, req.cache_salt, req.tenant)
                    usable = length
                else:
                    load_s += self.tiering.load_seconds(location.tier_run)
                    usable = location.num_blocks * self.segments.block_size
                # known tokens are not reused, nor is the prompt's last token
                run = max(0, min(start + usable, req.num_prompt_tokens - 1) - max(start, num_known))
                num_reused += run
                if i >= whole_from:
                    num_whole += run
                else:
                    num_sinks += min(run, how.sink_tokens)
            fresh.append(segment)
        tps = self.tiering.prefill_tokens_per_s
        work = blend_work(n, num_reused, spec.fraction, self.select_layer, self.model.config.num_layers,
                          how.selection, num_sinks, how.query_layer, self.in_batch, num_whole,
                          spec.num_asking_tokens(req.num_prompt_tokens, num_known))
        cost = work + (load_s * tps if tps else 0.0)
        log.debug("request %s: blend %.0f token-equivalents (%d reused, loads %.2f ms) vs prefill %d",
                  req.request_id, cost, num_reused, load_s * 1e3, n)
        if num_reused > 0 and (cost < n or not self.use_cost_model):
            return BlendPlan(num_known, tuple(fresh), max(num_known, spec.spans[0][0]))
        self.stats.num_declined += 1
        return None

    def start(self, req: Request, plan: BlendPlan, block_ids: list[int]) -> BlendTask:
        """``req``'s blend as ``plan`` says, its inputs read: the exact hit's KV from
        ``block_ids`` (its table), the segments' from the store (device, or loaded from the tiers).
        With ``in_batch`` the task only chooses the rows to recompute (``rows``); the engine's steps
        compute them."""
        spec, num_known = _spec(req), plan.num_known
        cached = [fresh if fresh is not None or start + length <= num_known
                  else self.segments.get(req.prompt_token_ids[start:start + length], 0, self.rope, req.cache_salt,
                                         req.tenant)
                  for (start, length), fresh in zip(spec.spans, plan.fresh)]
        known = read_tokens(self.storage, block_ids, req.prompt_token_ids[:num_known]) if num_known else None
        prompt = BlendPrompt(tuple(req.prompt_token_ids), spec.spans)
        how = self.how(spec)
        job = BlendJob(self.model, self.rope, prompt, cached, spec.fraction, self.select_layer, known,
                       how.selection, how.sink_tokens, how.query_layer, rows_only=self.in_batch,
                       last_segments=how.last_segments, attention=self.attention)
        return BlendTask(req, job, block_ids, num_known)

    def finish(self, task: BlendTask) -> BlendOutcome:
        """Write a complete blend's KV after the exact hit into the request's blocks."""
        blended, num_known = task.result, task.num_known
        if blended is None:
            raise ValueError(f"the blend of request {task.request.request_id} is not complete")
        if not isinstance(blended, Blended):
            raise TypeError("the task was started in_batch: its result is rows (``rows``)")
        write_tokens(self.storage, task.block_ids, num_known, [k[num_known:] for k in blended.keys],
                     [v[num_known:] for v in blended.values])
        self._count(blended.num_reused_tokens, blended.num_recomputed_tokens, blended.num_computed_tokens)
        return BlendOutcome(blended.logits.float().cpu().unsqueeze(0), blended.num_reused_tokens,
                            blended.num_recomputed_tokens, blended.num_computed_tokens)

    def rows(self, task: BlendTask) -> BlendRows:
        """A complete ``in_batch`` task's rows, for the engine's steps (``Request.blend_rows``)."""
        rows = task.result
        if rows is None:
            raise ValueError(f"the choice of request {task.request.request_id}'s rows is not complete")
        if not isinstance(rows, BlendRows):
            raise TypeError("the task was not started in_batch: its result is a whole blend (``finish``)")
        self._count(rows.num_reused_tokens, rows.num_recomputed_tokens,
                    len(rows.computed) - rows.num_recomputed_tokens)
        return rows

    # -- inside ----------------------------------------------------------------
    def _count(self, num_reused: int, num_recomputed: int, num_computed: int) -> None:
        s = self.stats
        s.num_blended += 1
        s.reused_tokens += num_reused
        s.recomputed_tokens += num_recomputed
        s.computed_tokens += num_computed

    def _put(self, segment: SegmentKV, salt: str, tenant: str = "") -> int:
        """Store a standalone segment; the tokens stored (0 when the pool has no room)."""
        try:
            stored = self.segments.put(segment, salt, tenant) * self.segments.block_size
        except NoFreeBlocksError:
            log.debug("segment of %d tokens not stored: no free block", segment.num_tokens)
            return 0
        self.stats.stored_tokens += stored
        return stored


def _spec(req: Request) -> BlendSpec:
    if req.blend is None:
        raise ValueError(f"request {req.request_id} has no segments to blend")
    return req.blend
