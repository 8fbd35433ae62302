"""A request: its tokens, its progress, and what it has produced.

The scheduler owns ``status`` and ``num_computed_tokens``; the KV manager owns the
request's blocks; the engine appends sampled tokens. Nobody else writes here.
"""

from __future__ import annotations

import enum
import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # eos, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or the context window
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # failed while running (``Request.error`` says why); other requests go on


class ErrorKind(str, enum.Enum):
    """Whose a request's failure is (``Request.error_kind``)."""

    CONSTRAINT = "constraint"   # its output constraint failed: the grammar it brought, its client's input
    ENGINE = "engine"           # anything else: the engine's


class ConstraintError(ValueError):
    """A request's output constraint failed (its grammar rejected a token or hit the grammar
    engine's limits): that request ends, with ``ErrorKind.CONSTRAINT``."""


class TokenConstraint(Protocol):
    """A request's grammar state (kvserve/sampling/structured.py): which tokens may come next.

    Owned by its request; only the sampler (masks) and the engine (accepted tokens) call it.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, one bit per token id);
        ConstraintError when the grammar fails here."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; ConstraintError when the grammar does not allow it or fails."""

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more: the output ends here."""

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar accepts from here (drafts)."""

    def masks_after(self, tokens: Sequence[int], words: int) -> list[torch.Tensor]:
        """The bitmasks after ``tokens[:1]``, ``tokens[:2]``, ... as far as the grammar accepts them
        and goes on; the state is left as it was (drafted rows, kvserve/sampling/rows.py)."""


class Resumed(NamedTuple):
    """Output a request already produced elsewhere (an engine replica that died mid-stream:
    kvserve/cluster/client.py): it continues from these tokens as if it had made them here."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()      # theirs, where the request asked for logprobs


DEFAULT_BLEND_FRACTION = 0.15     # CacheBlend's recompute ratio


def check_blend_fraction(fraction: float) -> float:
    """``fraction`` as a float; ValueError unless it is in [0, 1] (the one check of it)."""
    value = float(fraction)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"blend_fraction must be in [0, 1], got {fraction}")
    return value


@dataclass(frozen=True)
class BlendSpec:
    """A prompt's segments (documents whose KV may be reused from a standalone computation,
    at any position; kvserve/blend/) and the share of their tokens to recompute."""

    spans: tuple[tuple[int, int], ...]      # (first token, num_tokens) per segment, in order, disjoint
    fraction: float                         # blend_fraction: 0.0 reuses all, 1.0 recomputes all
    # this prompt's blend_selection, blend_sink_tokens and blend_last_segments; None: the engine's
    # (checked by SegmentedPrompt, which makes this spec)
    selection: str | None = None
    sink_tokens: int | None = None
    last_segments: int | None = None

    def __post_init__(self) -> None:
        check_blend_fraction(self.fraction)
        if not self.spans:
            raise ValueError("a blended prompt needs at least one segment span")
        end = 0
        for start, length in self.spans:
            if start < end or length < 1:
                raise ValueError(f"segment spans must be non-empty, in order and disjoint: {self.spans}")
            end = start + length

    def num_asking_tokens(self, num_tokens: int, num_known: int) -> int:
        """Tokens the query selections' first pass computes in a prompt of ``num_tokens`` whose
        first ``num_known`` are an exact prefix hit: those before the first segment and the
        question after the last (kvserve/blend/blending.py, ``_Context.asking``)."""
        (first, _), (last, length) = self.spans[0], self.spans[-1]
        return max(0, first - num_known) + num_tokens - max(last + length, num_known)


@dataclass(frozen=True)
class BlendRows:
    """A blended prompt's rows as the engine's steps compute them (``blend_in_batch``): from
    ``first`` (the exact prefix hit's end) to the prompt's end, the positions computed and those
    supplied, with the supplied positions' keys and values in every layer (the stored segments'
    moved KV, or, in the layers below the deviation selections' choice, the KV the choosing
    pass computed for them).

    Once a blend (kvserve/blend/) has chosen what to recompute, the rest of it is a prefill
    with gaps: the *computed* positions (the text that is not reused, and the reused tokens
    selected) run through every layer as chunks of the normal step, through the engine's
    attention backend and KV format; the *supplied* positions (the reused tokens not
    selected) run through no layer: their keys and values are written into the request's
    blocks by the same step, at their slots, as the chunk passes them. A chunk covers
    consecutive positions of both kinds; every computed row attends to every position before
    it, as the dense blend's rows do (a row only reads earlier positions, so chunks taken in
    position order give its exact computation, up to float order).

        positions   | head | doc a          | doc b         | question |
        computed    |  ccc |   c     cc     | cc  c         |  cccccc  |
        supplied    |      | ss sssss  sss  |   ss ssssss   |          |
        chunks      | <-- budget -->  | <-- budget -->   | <- rest -> |

    A chunk's computed rows cost what a blend's rows cost outside the batch (kvserve/blend/
    blending.py): each one token plus the keys it attends over ``keys_per_row``, so a chunk
    late in a long prompt holds fewer rows; the supplied rows cost nothing.
    """

    first: int
    computed: tuple[int, ...]           # ascending; the prompt's last position among them
    supplied: tuple[int, ...]           # ascending
    keys: tuple[torch.Tensor, ...]      # per layer [len(supplied), kv_heads, head_dim]
    values: tuple[torch.Tensor, ...]
    num_reused_tokens: int              # tokens whose stored KV was taken (those selected included)
    num_recomputed_tokens: int          # of those, selected: computed in every layer
    keys_per_row: float = math.inf      # attended keys that cost a row as much as its layer's weights

    def __post_init__(self) -> None:
        if not self.computed:
            raise ValueError("a blend computes at least the prompt's last token")
        if any(k.shape[0] != len(self.supplied) for k in (*self.keys, *self.values)):
            raise ValueError("one key and one value row per supplied position and layer")

    @property
    def end(self) -> int:
        """One past the prompt's last position."""
        return self.computed[-1] + 1

    def chunk(self, start: int, budget: int, max_positions: int) -> tuple[int, int, int]:
        """The chunk from position ``start``: (positions it covers, rows it computes, its cost
        rounded up). It ends right after its last computed row whose cost (with the rows' before
        it) stays within ``budget``, one row at least, or at the prompt's end; and it covers at
        most ``max_positions`` (a step's writes: the storage is sized for them), so where the next
        computed row lies further it covers that many supplied positions and computes nothing."""
        if budget < 1 or max_positions < 1:
            raise ValueError(f"a chunk's budget and positions are at least one, got {budget}, {max_positions}")
        first = last = bisect_left(self.computed, start)
        cost = 0.0
        while last < len(self.computed) and self.computed[last] < start + max_positions:
            row = 1.0 + (self.computed[last] + 1) / self.keys_per_row     # position p attends p + 1 keys
            if last > first and cost + row > budget:
                break
            cost += row
            last += 1
        if last == first:
            return max_positions, 0, 0
        return self.computed[last - 1] + 1 - start, last - first, math.ceil(cost - 1e-9)

    def computed_in(self, start: int, end: int) -> tuple[int, ...]:
        """The computed positions in [start, end)."""
        return self.computed[bisect_left(self.computed, start):bisect_left(self.computed, end)]

    def supplied_in(self, start: int, end: int) -> tuple[int, int]:
        """The supplied positions in [start, end), as a range of indices into ``supplied``."""
        return bisect_left(self.supplied, start), bisect_left(self.supplied, end)


class EncodedPrompt(NamedTuple):
    """A prompt as the engine takes it: token ids, and the spans of its segments when it has
    any (kvserve/blend/). What every front end (the Python API, the server, a cluster's
    ingress) hands the engine, so a prompt is tokenized once, where it enters."""

    token_ids: list[int]
    blend: BlendSpec | None = None


class TokenLogprob(NamedTuple):
    """A token's logprob and the top alternatives at its position (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    priority: int = 0
    max_tokens: int = 16
    retention_class: int = 0                # eviction class of the blocks it holds (kvserve/cache_control.py)
    cache_salt: str = ""                    # its blocks' keys are salted with it (kvserve/cache_control.py)
    tenant: str = ""                        # ... and with its tenant's name: the pair is its cache namespace
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None   # set at first admission
    num_reused_tokens: int = 0             # blended: prompt tokens whose KV came from stored segments
    num_recomputed_tokens: int = 0         # of those, recomputed by blending
    num_preemptions: int = 0
    num_draft_tokens: int = 0              # speculative decoding: drafted tokens checked for it
    num_accepted_tokens: int = 0           # of those, accepted
    waited_steps: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    constraint: TokenConstraint | None = None   # set by the engine for structured outputs
    blend: BlendSpec | None = None               # segments to blend at first admission (kvserve/blend/)
    blend_rows: BlendRows | None = None          # a blend the steps are computing (``BlendRows``)
    error: str | None = None                     # why it finished with FinishReason.ERROR
    error_kind: ErrorKind | None = None          # ... and whose failure that was
    # text produced so far (kept only when stop strings need it)
    output_text: str = ""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
