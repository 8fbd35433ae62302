"""What the sampler reads of a logits row's request: its options and the state they apply to.

A row is usually a request as it stands. A request with k drafted tokens (kvserve/speculative/) has
k more rows, row i giving the token after its i-th drafted one: for that row the request is
as if the first i drafted tokens were already appended (``DraftedRow``), so penalties count
them, ``min_tokens`` counts them, and the grammar's mask is the one after them. Each row is
then processed exactly as plain decoding would process it, had the drafts been its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


class RowConstraint(Protocol):
    """What the sampler asks of a row's grammar: the tokens allowed next."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


class RowRequest(Protocol):
    """The request of one logits row (a ``Request``, or a ``DraftedRow`` of one)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def constraint(self) -> RowConstraint | None: ...

    @property
    def generator(self) -> torch.Generator | None: ...


class FixedMask:
    """A grammar's mask computed ahead (the state after drafted tokens), as a drafted row's
    ``constraint``."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.mask)


@dataclass(frozen=True)
class DraftedRow:
    """``request`` after its drafted tokens ``drafted`` (the first i of a draft), for the row that
    gives the token after them. ``mask``: the grammar's mask there (None: no grammar, or a state
    ``masks_after`` could not give, see ``drafted_rows``)."""

    request: Request
    drafted: tuple[int, ...]
    mask: torch.Tensor | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.drafted]

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.all_token_ids, *self.drafted]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafted)

    @property
    def constraint(self) -> RowConstraint | None:
        return None if self.mask is None else FixedMask(self.mask)

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator


def drafted_rows(request: Request, draft: Sequence[int], vocab_size: int) -> list[RowRequest]:
    """The rows of ``request`` with ``draft`` (k tokens): the request itself, then k drafted rows.

    With a grammar, row i's mask is the grammar's after ``draft[:i]``. A row past the first drafted
    token the grammar rejects gets none and is never used (the row before masks that token out,
    so verification stops there); a row after a state whose mask failed gets none either: if
    the run gets that far, the request's own grammar fails on the next step, as in plain decoding."""
    masks: list[torch.Tensor] = []
    if request.constraint is not None:
        masks = request.constraint.masks_after(draft, (vocab_size + 31) // 32)
    rows: list[RowRequest] = [request]
    for i in range(1, len(draft) + 1):
        rows.append(DraftedRow(request, tuple(draft[:i]), masks[i - 1] if i <= len(masks) else None))
    return rows
