"""Blending: a prompt's KV from its segments' cached KV plus a partial recompute (CacheBlend).

A prompt has segments (documents) among its text. A segment whose standalone KV is cached is
*reused*: its keys are moved to its place, but they never saw the text before it, so the
attention across segments is missing. Layers below ``select_layer`` are computed for every
token (cheap: one or two layers). At ``select_layer`` each reused token's fresh keys and
values are compared with the cached ones; per segment, the ``blend_fraction`` of tokens that
deviate most are *selected*, and from that layer on only they and the computed tokens (the
prefix, the suffix, segment tails that were not cached) are computed; the other reused
tokens keep their cached KV.

    positions    | prefix | segment 1      | segment 2   | suffix |
    layers < s   |  all computed                                  |
    layers >= s  |  comp. | c c S c c S c  | c S c c c c |  comp. |   c: cached KV, S: selected

With ``blend_fraction`` 1.0 every token is computed in every layer: a full prefill.

It runs on one sequence with dense tensors (the whole prompt's KV per layer); the engine
writes the result into the request's blocks (``blender.py``). Tokens whose exact KV is
already cached (a prefix-cache hit, ``known``) are neither computed nor reused. Attention
goes through the attention backend given (``AttentionBackend.attend_dense``: the engine's;
None: the one ``auto`` picks on the model's device, an engine's default).

``BlendJob`` runs the same computation a few layers at a time (``advance``, by a budget of
work), so the engine can interleave a long blend with its steps; ``blend_prefill`` runs it
whole. The passes are generators that yield, per layer, the rows computed and the keys they
attended. Work is counted in token-layers: a row through one layer's weights is 1, and each
key it attends adds ``1 / attention_keys_per_row`` (the multiply-adds of one key against
those of the projections and the MLP), so a blend's share of a step costs what its budget
says even where the prompt is long and attention dominates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.attention.backends import AUTO, AttentionBackend, make_attention_backend
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import SegmentKV
from kvserve.config import QUERY_SELECTIONS, ModelConfig, check_blend_selection
from kvserve.model.decoder import Decoder
from kvserve.request import DEFAULT_BLEND_FRACTION, BlendRows, check_blend_fraction


@dataclass(frozen=True)
class BlendPrompt:
    """A prompt's token ids and its segments' spans (first token, num_tokens), in order."""

    token_ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def join(cls, prefix: Sequence[int], segments: Sequence[Sequence[int]], suffix: Sequence[int]) -> BlendPrompt:
        """A prefix, segments back to back, a suffix."""
        ids, spans = list(prefix), []
        for segment in segments:
            spans.append((len(ids), len(segment)))
            ids.extend(segment)
        return cls(tuple(ids + list(suffix)), tuple(spans))

    @property
    def segments(self) -> list[tuple[int, ...]]:
        return [self.token_ids[start:start + length] for start, length in self.spans]

    @property
    def segment_starts(self) -> list[int]:
        """Position of each segment's first token."""
        return [start for start, _ in self.spans]


@dataclass(frozen=True)
class Blended:
    keys: tuple[torch.Tensor, ...]      # per layer [num_tokens, kv_heads, head_dim], the prompt's KV
    values: tuple[torch.Tensor, ...]
    logits: torch.Tensor                # [vocab] float32: the next token after the prompt
    selected: torch.Tensor              # positions of the reused tokens recomputed from select_layer on
    num_reused_tokens: int              # tokens whose cached KV was taken (those selected included)
    num_computed_tokens: int            # tokens computed in every layer (not known, not reused)

    @property
    def num_recomputed_tokens(self) -> int:
        return int(self.selected.numel())


@torch.inference_mode()
def blend_prefill(model: Decoder, rope: RopeTables, prompt: BlendPrompt, cached: Sequence[SegmentKV | None],
                  blend_fraction: float = DEFAULT_BLEND_FRACTION, select_layer: int = 1, known: SegmentKV | None = None,
                  selection: str = "deviation", sink_tokens: int = 0, query_layer: int | None = None,
                  last_segments: int = 0, attention: AttentionBackend | None = None) -> Blended:
    """The prompt's KV and next-token logits from ``cached[i]``, the standalone KV of segment
    i's leading tokens (None: computed in full), recomputing ``blend_fraction`` of them, chosen
    by ``selection`` (``config.BLEND_SELECTIONS``), each segment's first ``sink_tokens`` always among them;
    the query selections read the question's attention at ``query_layer`` (None: every layer, summed).
    The last ``last_segments`` segments (nearest the question) are recomputed whole, the fraction
    taken of the others.
    ``known``: the exact KV of the prompt's first tokens (a prefix-cache hit), taken as is;
    segment tokens it covers are not reused. ``attention``: the backend the passes attend through
    (module docstring)."""
    job = BlendJob(model, rope, prompt, cached, blend_fraction, select_layer, known, selection, sink_tokens,
                   query_layer, last_segments=last_segments, attention=attention)
    done = job.advance(math.inf)
    assert isinstance(done, Blended)
    return done


class BlendJob:
    """``blend_prefill``'s computation, run a few layers at a time. The arguments are checked
    here; ``advance`` raises what the computation raises."""

    def __init__(self, model: Decoder, rope: RopeTables, prompt: BlendPrompt, cached: Sequence[SegmentKV | None],
                 blend_fraction: float = DEFAULT_BLEND_FRACTION, select_layer: int = 1,
                 known: SegmentKV | None = None, selection: str = "deviation", sink_tokens: int = 0,
                 query_layer: int | None = None, rows_only: bool = False, last_segments: int = 0,
                 attention: AttentionBackend | None = None) -> None:
        """``rows_only``: stop once the recomputed tokens are chosen, the result a ``BlendRows``
        for the engine's steps to compute (``blend_in_batch``) instead of a ``Blended``."""
        _check(model, prompt, cached, blend_fraction, select_layer, known, selection, sink_tokens, query_layer,
               last_segments)
        body = _rows_steps if rows_only else _blend_steps

        def steps() -> Generator[tuple[int, int], None, Blended | BlendRows]:
            ctx, runs = _Context.of(model, rope, prompt, cached, known, last_segments, attention)
            return (yield from body(ctx, runs, blend_fraction, select_layer, selection, sink_tokens, query_layer))

        self._steps = steps()
        self.keys_per_row = attention_keys_per_row(model.config)
        self.num_row_layers = 0         # rows computed so far, summed over the layers
        self.num_key_layers = 0         # keys those rows attended, summed over the layers
        self.work = 0.0                 # token-layers: rows + keys / keys_per_row

    @torch.inference_mode()
    def advance(self, max_work: float) -> Blended | BlendRows | None:
        """Compute layers until ``max_work`` token-layers are done (one layer at least,
        whatever it costs); the result when the blend is complete, else None."""
        spent = 0.0
        while True:
            try:
                rows, keys = next(self._steps)
            except StopIteration as stop:
                done: Blended | BlendRows = stop.value
                return done
            work = rows + keys / self.keys_per_row
            spent += work
            self.work += work
            self.num_row_layers += rows
            self.num_key_layers += keys
            if spent >= max_work:
                return None


def attention_keys_per_row(config: ModelConfig) -> float:
    """How many attended keys cost a row as many multiply-adds as one layer's projections and
    MLP (q, k, v, o and the three MLP matrices, against 2 x heads x head_dim per key: scores
    and the weighted sum): 3,072 for SmolLM2-135M."""
    q, kv, h = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size
    linear = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    return linear / (2 * q)


def backend_of(model: Decoder, attention: AttentionBackend | None) -> AttentionBackend:
    """``attention``, or where it is None the backend an engine on the model's device runs by default."""
    return attention if attention is not None else make_attention_backend(AUTO, model.device)


def _check(model: Decoder, prompt: BlendPrompt, cached: Sequence[SegmentKV | None], blend_fraction: float,
           select_layer: int, known: SegmentKV | None, selection: str, sink_tokens: int,
           query_layer: int | None, last_segments: int) -> None:
    num_layers = model.config.num_layers
    check_blend_fraction(blend_fraction)
    check_blend_selection(selection, sink_tokens, last_segments)
    if not 1 <= select_layer < num_layers:
        raise ValueError(f"select_layer must be in 1..{num_layers - 1}, got {select_layer}")
    if query_layer is not None and not 0 <= query_layer < num_layers:
        raise ValueError(f"query_layer must be in 0..{num_layers - 1}, got {query_layer}")
    if len(cached) != len(prompt.spans):
        raise ValueError(f"{len(cached)} cached entries for {len(prompt.spans)} segments")
    num_known = 0 if known is None else known.num_tokens
    if known is not None and (known.first_position != 0 or known.token_ids != prompt.token_ids[:num_known]
                              or num_known >= len(prompt.token_ids)):
        raise ValueError("known KV must be an exact computation of fewer than all of the prompt's leading tokens")


def _blend_steps(ctx: _Context, runs: list[tuple[int, int]], blend_fraction: float, select_layer: int,
                 selection: str, sink_tokens: int,
                 query_layer: int | None) -> Generator[tuple[int, int], None, Blended]:
    """``blend_prefill``'s body (arguments checked): yields per layer the rows computed and
    the keys they attended."""
    model, n, num_known, is_reused = ctx.model, ctx.n, ctx.num_known, ctx.is_reused
    num_reused = int(ctx.reused.numel())
    everything = torch.ones(n, dtype=torch.bool, device=model.device)
    if selection in QUERY_SELECTIONS and num_reused:
        selected = yield from _ask(ctx, runs, selection, blend_fraction, sink_tokens, query_layer)
        computed = ~is_reused
        computed[selected] = True
        done = (yield from ctx.run(computed))._replace(selected=selected)
    elif num_reused:
        choose_at, choose = _deviation_choice(ctx, runs, blend_fraction, select_layer, selection, sink_tokens)
        done = yield from ctx.run(everything, choose_at=choose_at, choose=choose)
    else:
        done = yield from ctx.run(everything)
    return Blended(tuple(done.keys), tuple(done.values), done.logits, done.selected, num_reused,
                   n - num_known - num_reused)


def _rows_steps(ctx: _Context, runs: list[tuple[int, int]], blend_fraction: float, select_layer: int,
                selection: str, sink_tokens: int,
                query_layer: int | None) -> Generator[tuple[int, int], None, BlendRows]:
    """``blend_prefill``'s choice alone (arguments checked), what the engine's steps then compute
    (``BlendRows``): the query selections' first pass, or the deviation selections' pass over
    every token up to the last layer that chooses. Yields per layer as ``_blend_steps``."""
    model, n, num_known, reused, is_reused = ctx.model, ctx.n, ctx.num_known, ctx.reused, ctx.is_reused
    # per layer up to the choosing pass's last, the KV of every position as that pass had it
    passed_keys: list[torch.Tensor] = []
    passed_values: list[torch.Tensor] = []
    if selection in QUERY_SELECTIONS and reused.numel():
        selected = yield from _ask(ctx, runs, selection, blend_fraction, sink_tokens, query_layer)
    elif reused.numel():
        choose_at, choose = _deviation_choice(ctx, runs, blend_fraction, select_layer, selection, sink_tokens)
        everything = torch.ones(n, dtype=torch.bool, device=model.device)
        chose = yield from ctx.run(everything, choose_at=choose_at, choose=choose, last_layer=max(choose_at))
        selected, passed_keys, passed_values = chose.selected, chose.keys, chose.values
    else:
        selected = reused
    computed = ~is_reused
    computed[selected] = True
    computed[:num_known] = False
    supplied = torch.nonzero(~computed[num_known:]).flatten() + num_known
    among_reused = ~computed[reused]        # the supplied positions, in the cached KV's order
    cfg = model.config
    if not reused.numel():      # nothing could be reused after all (a segment not loaded): every row computed
        none = torch.empty((0, cfg.num_kv_heads, cfg.head_dim), dtype=model.dtype, device=model.device)
        keys = values = (none,) * cfg.num_layers
    else:
        # layer by layer, each layer's choosing tensors dropped once its supplied rows are copied
        # out: the peak is one layer's copy beside them, not a second copy of every layer
        gone = torch.empty(0, device=model.device)
        kept_keys, kept_values = [], []
        for layer in range(cfg.num_layers):
            if layer < len(passed_keys):
                kept_keys.append(passed_keys[layer][supplied])
                kept_values.append(passed_values[layer][supplied])
                passed_keys[layer] = passed_values[layer] = gone
            else:
                kept_keys.append(ctx.cached_keys[layer][among_reused])
                kept_values.append(ctx.cached_values[layer][among_reused])
            ctx.cached_keys[layer] = ctx.cached_values[layer] = gone
        keys, values = tuple(kept_keys), tuple(kept_values)
    return BlendRows(num_known, tuple(torch.nonzero(computed).flatten().tolist()), tuple(supplied.tolist()),
                     keys, values, int(reused.numel()), int(selected.numel()), attention_keys_per_row(model.config))


def _ask(ctx: _Context, runs: list[tuple[int, int]], selection: str, blend_fraction: float, sink_tokens: int,
         query_layer: int | None) -> Generator[tuple[int, int], None, torch.Tensor]:
    """The query selections' choice: the text after the last segment (the question) computed
    first, every reused token as cached (``_Context.asking``); where its queries attend picks
    what to recompute, in every layer (read at one layer, the pass stops there: the layers above
    it would change nothing read). The reused positions picked."""
    asked = yield from ctx.run(ctx.asking(), read_question=True, question_layer=query_layer,
                               last_layer=query_layer)
    assert asked.attention is not None
    pick = _pick if selection == "query" else _pick_segments
    return ctx.pick(asked.attention[ctx.reused], runs, lambda score, some: pick(score, some, blend_fraction,
                                                                                 sink_tokens))


Choose = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _deviation_choice(ctx: _Context, runs: list[tuple[int, int]], blend_fraction: float, select_layer: int,
                      selection: str, sink_tokens: int) -> tuple[tuple[int, ...], Choose]:
    """The deviation selections' choosing layers and ``choose`` (``_Context.run``): per choosing
    layer, the share of each segment kept computed from there on, the tokens whose fresh KV
    deviates most from the cached."""
    model, n, dev = ctx.model, ctx.n, ctx.model.device
    reused, is_reused, num_reused = ctx.reused, ctx.is_reused, int(ctx.reused.numel())
    fractions = (narrowing_fractions(blend_fraction, model.config.num_layers - select_layer)
                 if selection == "narrowing" else (blend_fraction,))
    share = {select_layer + i: f for i, f in enumerate(fractions)}
    index = torch.full((n,), -1, dtype=torch.long, device=dev)      # position -> its row among the reused
    index[reused] = torch.arange(num_reused, device=dev)

    def choose(layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        current = is_reused[rows]                   # the reused rows still computed at this layer
        at = index[rows[current]]
        score = torch.full((num_reused,), -math.inf, device=dev)
        score[at] = _deviation(k[current], v[current], ctx.cached_keys[layer][at], ctx.cached_values[layer][at])
        return ctx.pick(score, runs, lambda score, some: _pick(score, some, share[layer], sink_tokens))

    return tuple(share), choose


class _Pass(NamedTuple):
    keys: list[torch.Tensor]        # per layer [n, kv_heads, head_dim] (the present positions')
    values: list[torch.Tensor]
    logits: torch.Tensor            # after the prompt's last token
    selected: torch.Tensor          # the reused positions ``choose`` named (none without it)
    attention: torch.Tensor | None  # [n]: with ``read_question``, the attention the question gave each position
    layer_attention: tuple[torch.Tensor, ...]   # the same per layer read (every layer without ``question_layer``)


class _Context:
    """One prompt's blend: what is known, reused and cached, for passes over the layers."""

    def __init__(self, model: Decoder, token_ids: list[int], num_known: int, known: SegmentKV | None,
                 reused: torch.Tensor, is_reused: torch.Tensor, cached_keys: list[torch.Tensor],
                 cached_values: list[torch.Tensor], question_from: int, whole_from: int, first_reused: int,
                 backend: AttentionBackend) -> None:
        self.model, self.token_ids, self.num_known, self.known = model, token_ids, num_known, known
        self.backend = backend                          # the passes attend through it (``attend_dense``)
        self.reused, self.is_reused = reused, is_reused
        self.first_reused = first_reused                # the first reused position (n where none is)
        self.cached_keys, self.cached_values = cached_keys, cached_values
        self.n = len(token_ids)
        # the question: the text after the last segment, not after the last reused run (a
        # segment stored in whole blocks leaves its tail to be computed, and that tail's rows
        # attend to the tokens just before them, not to what the question asks for)
        self.question_from = question_from
        self.whole_from = whole_from                    # the first position of the segments recomputed whole
        self.whole = reused[reused >= whole_from]      # the reused positions always recomputed

    @classmethod
    def of(cls, model: Decoder, rope: RopeTables, prompt: BlendPrompt, cached: Sequence[SegmentKV | None],
           known: SegmentKV | None, last_segments: int = 0,
           attention: AttentionBackend | None = None) -> tuple[_Context, list[tuple[int, int]]]:
        """The context of ``prompt`` (arguments checked) and its reused runs (``_place``); the
        reused tokens of its last ``last_segments`` segments always recomputed; its passes
        attend through ``attention`` (``backend_of``)."""
        num_known = 0 if known is None else known.num_tokens
        runs, cached_keys, cached_values = _place(prompt, cached, rope, num_known)
        dev, n = model.device, len(prompt.token_ids)
        reused = torch.tensor([p for start, length in runs for p in range(start, start + length)],
                              dtype=torch.long, device=dev)
        is_reused = torch.zeros(n, dtype=torch.bool, device=dev)
        is_reused[reused] = True
        last = prompt.spans[-1][0] + prompt.spans[-1][1] if prompt.spans else n - 1
        whole = prompt.spans[max(0, len(prompt.spans) - last_segments):] if last_segments else ()
        ctx = cls(model, list(prompt.token_ids), num_known, known, reused, is_reused, cached_keys, cached_values,
                  min(last, n - 1), whole[0][0] if whole else n, runs[0][0] if runs else n,
                  backend_of(model, attention))
        return ctx, runs

    def pick(self, score: torch.Tensor, runs: list[tuple[int, int]],
             choose: Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]) -> torch.Tensor:
        """The reused positions recomputed, sorted: ``choose(score, runs)`` over the runs before
        the segments recomputed whole (``score`` [num_reused], the runs' tokens in order), and
        those segments' tokens."""
        some = [(start, length) for start, length in runs if start + length <= self.whole_from]
        if not some:
            return self.whole
        chosen = choose(score[:sum(length for _, length in some)], some)
        return torch.unique(torch.cat([chosen, self.whole]))

    def asking(self) -> torch.Tensor:
        """What the query selections' first pass computes ([n] bool): the text before the first
        reused token and the question. The text between them that is not reused (the
        separators, the tails of segments stored in whole blocks) is left out of that pass:
        the question reads the prefix, the segments as cached and itself, and the pass costs
        the question's rows, not every separator's (at k = 8 documents, ~50 rows of ~190)."""
        asking = ~self.is_reused
        asking[self.first_reused:self.question_from] = False
        return asking

    def run(self, computed: torch.Tensor, choose_at: tuple[int, ...] = (),
            choose: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
            read_question: bool = False, question_layer: int | None = None,
            last_layer: int | None = None) -> Generator[tuple[int, int], None, _Pass]:
        """Every layer (yielding the rows it computed and the keys they attended, causally) for
        the positions ``computed`` ([n] bool; from num_known on, the prompt's last among them);
        the others' KV known or cached, and a position neither known, reused nor computed left
        out (no row attends to it; the pass's KV holds the others, in order). At each layer of
        ``choose_at``, ``choose(layer, rows, k, v)`` (the positions computed so far and that
        layer's fresh keys and values of them; at the first, every position from num_known on)
        names the reused positions computed from there on with the ones not reused: a subset of
        ``rows``. With ``read_question``: also the attention the question's positions
        (``question_from`` on) give each position, summed over them, the heads and the layers
        (only layer ``question_layer`` where given). With
        ``last_layer``, the pass ends after that layer: its keys and values for the layers run,
        no logits (an empty tensor)."""
        model, num_known, known, reused, n = self.model, self.num_known, self.known, self.reused, self.n
        dev, backend = model.device, self.backend
        rows = torch.arange(n, device=dev)[num_known:][computed[num_known:]]   # the positions ``h`` holds
        present = computed.clone()
        present[:num_known] = True
        present[reused] = True
        size = int(present.sum())                       # positions in the pass's KV
        kept = torch.nonzero(present).flatten()
        slot = torch.cumsum(present, 0) - 1             # position -> its row of the pass's KV (where present)
        reused_at = slot[reused]
        h = model.embed(torch.tensor(self.token_ids, dtype=torch.long, device=dev)[rows])
        selected = reused[:0]
        attention = torch.zeros(n, device=dev) if read_question else None
        layer_attention: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        num_layers = model.config.num_layers if last_layer is None else last_layer + 1
        for layer in range(num_layers):
            q, k, v = model.layer_qkv(layer, h, model.angles(rows))
            if choose is not None and layer in choose_at:
                selected = choose(layer, rows, k, v)
                keep = ~self.is_reused
                keep[selected] = True
                keep = keep[rows]
                rows = rows[keep]
                q, k, v, h = q[keep], k[keep], v[keep], h[keep]
            at = slot[rows]                              # the rows' places in the pass's KV
            if rows.numel() < size:
                # the layer's KV: known, cached where reused, fresh where computed (selected tokens included)
                # as many rows as the backend reads in place (``dense_rows``); the pass keeps [:size]
                k_all = torch.empty((backend.dense_rows(size), *k.shape[1:]), dtype=k.dtype, device=dev)
                v_all = torch.empty_like(k_all)
                if known is not None:
                    k_all[:num_known], v_all[:num_known] = known.keys[layer], known.values[layer]
                if reused.numel():
                    k_all[reused_at], v_all[reused_at] = self.cached_keys[layer], self.cached_values[layer]
                k_all[at], v_all[at] = k, v
                k, v = k_all, v_all
            if attention is not None and question_layer in (None, layer):
                asking = rows >= self.question_from
                read = torch.zeros(n, device=dev)
                read[kept] = _query_attention(q[asking], k[:size], at[asking], model.scale)
                layer_attention.append(read)
                attention += read
            keys.append(k[:size])
            values.append(v[:size])
            if layer < num_layers - 1 or last_layer is None:    # a last layer's output is never read
                h = model.layer_output(layer, h, backend.attend_dense(q, k, v, at, model.scale))
            yield int(rows.numel()), int(at.sum()) + int(rows.numel())     # row i of the KV attends i + 1 keys
        if last_layer is not None:
            return _Pass(keys, values, h.new_empty(0), selected, attention, tuple(layer_attention))
        logits = model.compute_logits(model.final_norm_of(h[-1:]))[0]
        return _Pass(keys, values, logits, selected, attention, tuple(layer_attention))


def _place(prompt: BlendPrompt, cached: Sequence[SegmentKV | None], rope: RopeTables,
           num_known: int) -> tuple[list[tuple[int, int]], list[torch.Tensor], list[torch.Tensor]]:
    """Each reused run (start, length) and, per layer, the runs' cached keys (moved to their
    places) and values, concatenated in position order. A run starts at ``num_known`` at the
    earliest (known tokens are not reused) and ends before the prompt's last token (its
    hidden state gives the logits)."""
    n = len(prompt.token_ids)
    runs: list[tuple[int, int]] = []
    moved: list[SegmentKV] = []
    for (start, length), kv in zip(prompt.spans, cached):
        if kv is None or not kv.num_tokens:
            continue
        if kv.first_position != 0 or kv.token_ids != prompt.token_ids[start:start + min(length, kv.num_tokens)] \
                or kv.num_tokens > length:
            raise ValueError("cached KV must be a standalone computation of the segment's leading tokens")
        skip = max(0, num_known - start)
        end = min(start + kv.num_tokens, n - 1)
        if end > start + skip:
            runs.append((start + skip, end - start - skip))
            moved.append(kv.span(skip, end - start).moved_to(start + skip, rope))
    if not moved:
        return runs, [], []
    num_layers = moved[0].num_layers
    keys = [torch.cat([m.keys[layer] for m in moved]) for layer in range(num_layers)]
    values = [torch.cat([m.values[layer] for m in moved]) for layer in range(num_layers)]
    return runs, keys, values


def _deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor,
               cached_v: torch.Tensor) -> torch.Tensor:
    """CacheBlend's score of each reused token: the squared L2 distance of its fresh keys and
    values from the cached ones, together. [num_reused]."""
    return ((fresh_k.float() - cached_k.float()) ** 2).sum((1, 2)) + \
        ((fresh_v.float() - cached_v.float()) ** 2).sum((1, 2))


def _query_attention(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention queries ``q`` ([m, H, D], at ``positions``) give each position of ``keys``
    ([n, Hkv, D]), causally, summed over the queries and the heads: [n]."""
    n, kv_heads = keys.shape[0], keys.shape[1]
    m, heads = q.shape[0], q.shape[1]
    qg = q.float().view(m, kv_heads, heads // kv_heads, q.shape[-1])
    logits = torch.einsum("mhgd,nhd->hgmn", qg, keys.float()) * scale      # [Hkv, group, m, n]
    visible = torch.arange(n, device=keys.device)[None, :] <= positions[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=(0, 1, 2))


NARROWING = (2.0, 1.5, 1.0)    # ``narrowing``: the fraction's multiples kept at the first choosing layers


def narrowing_fractions(fraction: float, num_layers_from: int) -> tuple[float, ...]:
    """The share of each segment kept at ``select_layer``, the next layer and so on, down to
    ``fraction`` (CacheBlend's gradual filtering: each layer chooses among the tokens the
    layer before kept, by its own deviation); the schedule's tail where fewer than its
    length of layers are left from ``select_layer`` on (``num_layers_from``)."""
    return tuple(min(1.0, m * fraction) for m in NARROWING[-num_layers_from:])


SINK_SPAN = 32    # a segment's first tokens, a spurious attention sink: left out of its score as a whole


def _peaks(score: torch.Tensor, runs: list[tuple[int, int]]) -> list[tuple[float, int]]:
    """Each run's largest ``score`` past its first SINK_SPAN tokens (all of a shorter run), and
    where in the run it is (the first such token on a tie)."""
    best, offset = [], 0
    for _, length in runs:
        skip = SINK_SPAN if length > SINK_SPAN else 0
        run = score[offset + skip:offset + length]
        at = int(run.argmax())
        best.append((float(run[at]), skip + at))
        offset += length
    return best


def _pick_segments(score: torch.Tensor, runs: list[tuple[int, int]], fraction: float,
                   sink_tokens: int) -> torch.Tensor:
    """``ceil(fraction * reused tokens)`` positions in windows: the runs best first by their
    peak (``_peaks``), from each a contiguous window centred on its peak token (moved inside
    the run at its ends), the whole run while the count allows, the last window what is left;
    and every run's first ``sink_tokens``. Positions, sorted."""
    best = _peaks(score, runs)
    wanted = math.ceil(fraction * sum(length for _, length in runs) - 1e-9)
    picked = [_pick(score, runs, 0.0, sink_tokens)]
    for i in sorted(range(len(runs)), key=lambda i: (-best[i][0], i)):
        if wanted <= 0:
            break
        start, length = runs[i]
        count = min(length, wanted)
        first = max(0, min(best[i][1] - count // 2, length - count))
        picked.append(torch.arange(start + first, start + first + count, device=score.device))
        wanted -= count
    return torch.unique(torch.cat(picked))


def _pick(score: torch.Tensor, runs: list[tuple[int, int]], fraction: float, sink_tokens: int) -> torch.Tensor:
    """Positions of each run's ``ceil(fraction * length)`` tokens (at least its first
    ``sink_tokens``, always taken) of highest ``score`` ([num_reused], the runs' tokens in
    order), sorted."""
    picked, offset = [], 0
    for start, length in runs:
        count = math.ceil(fraction * length - 1e-9)     # 0.1 * 30 is 3.0000000000000004
        sinks = min(sink_tokens, length)
        rest = score[offset + sinks:offset + length]
        top = torch.topk(rest, max(0, count - sinks)).indices + sinks
        picked.append(torch.cat([torch.arange(sinks, device=score.device), top]) + start)
        offset += length
    return torch.sort(torch.cat(picked)).values


@torch.inference_mode()
def segment_peaks_by_layer(model: Decoder, rope: RopeTables, prompt: BlendPrompt, cached: Sequence[SegmentKV],
                           attention: AttentionBackend | None = None) -> list[list[float]]:
    """Per layer, each segment's score as ``query-segments`` reads it with that layer as
    ``blend_query_layer``: the question's first-pass attention (every segment as cached),
    its largest weight on the segment's tokens past the first SINK_SPAN. What
    ``kvserve eval-blend-layer`` calibrates the layer from. Every segment must be cached whole."""
    if len(cached) != len(prompt.spans) or any(c.num_tokens != n for c, (_, n) in zip(cached, prompt.spans)):
        raise ValueError("every segment's standalone KV is needed, whole")
    _check(model, prompt, cached, 0.0, 1, None, "query-segments", 0, None, 0)
    ctx, runs = _Context.of(model, rope, prompt, cached, None, attention=attention)
    passes = ctx.run(ctx.asking(), read_question=True)     # one first pass, every layer read
    while True:
        try:
            next(passes)
        except StopIteration as stop:
            asked: _Pass = stop.value
            break
    return [[peak for peak, _ in _peaks(attention[ctx.reused], runs)] for attention in asked.layer_attention]


@torch.inference_mode()
def extend(model: Decoder, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], token_ids: Sequence[int],
           attention: AttentionBackend | None = None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Compute ``token_ids`` after the KV ``keys``/``values`` (per layer [n, kv_heads, head_dim]):
    the last token's logits and the KV grown by them. Continues a blended prompt (tests, the
    accuracy checks of a benchmark), attending through ``attention`` (``backend_of``)."""
    n, dev, attention = keys[0].shape[0], model.device, backend_of(model, attention)
    rows = torch.arange(n, n + len(token_ids), device=dev)
    angles = model.angles(rows)
    h = model.embed(torch.tensor(list(token_ids), dtype=torch.long, device=dev))
    new_keys, new_values = [], []
    for layer in range(model.config.num_layers):
        q, k, v = model.layer_qkv(layer, h, angles)
        k, v = torch.cat([keys[layer], k]), torch.cat([values[layer], v])
        new_keys.append(k)
        new_values.append(v)
        h = model.layer_output(layer, h, attention.attend_dense(q, k, v, rows, model.scale))
    return model.compute_logits(model.final_norm_of(h[-1:]))[0], new_keys, new_values


def greedy_tokens(model: Decoder, blended: Blended, max_tokens: int,
                  attention: AttentionBackend | None = None) -> list[int]:
    """``max_tokens`` greedy tokens after a blended prompt (``extend``)."""
    out: list[int] = []
    attention = backend_of(model, attention)
    logits, keys, values = blended.logits, list(blended.keys), list(blended.values)
    for _ in range(max_tokens):
        out.append(int(torch.argmax(logits)))
        if len(out) < max_tokens:
            logits, keys, values = extend(model, keys, values, out[-1:], attention)
    return out
