"""A request: its tokens, its progress, and what it has produced.

The scheduler owns ``status`` and ``num_computed_tokens``; the KV manager owns the
request's blocks; the engine appends sampled tokens. Nobody else writes here.
"""

from __future__ import annotations

import enum
import time
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


class TokenConstraint(Protocol):
    """A request's grammar state (kvserve/sampling/structured.py): which tokens may come next.

    Owned by its request; only the sampler (masks) and the engine (accepted tokens) call it.
    """

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, one bit per token id)."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; ValueError when the grammar does not allow it."""

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

    def __post_init__(self) -> None:
        check_blend_fraction(self.fraction)
        end = 0
        for start, length in self.spans:
            if start < end or length < 1:
                raise ValueError(f"segment spans must be non-empty, in order and disjoint: {self.spans}")
            end = start + length


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
    error: str | None = None                     # why it finished with FinishReason.ERROR
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
