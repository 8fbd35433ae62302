"""KV budget policies: which cached entries a request keeps when its context outgrows its budget.

A policy is looked up by the name the user types (``--kv-policy``). Token policies
choose, per layer and per KV head, which ``budget`` slots of the request's cache to
keep; ``arkvale`` works on whole blocks (see ``arkvale.py``).

    policy      keeps                                               scores from
    streaming   4 sink tokens + the most recent tokens              positions
    h2o         heavy hitters + a recent window of budget/2          attention of every query
    snapkv      top pooled tokens + the observation window           attention of the window's queries
    pyramid     snapkv, with budgets from 1.5x (first layer) to 0.5x (last), in whole blocks
                (the same total, rounded down to a block)
    merge       h2o's choice; evicted entries merged into their most similar kept entry
    saliency    top pooled saliency (ZipCache's normalized attention) + the window   attention of probe queries
    saliency-blocks  whole blocks: the first, the window's and the most salient, budget/block_size in all;
                a compaction moves no entry                                        attention of probe queries
    arkvale     the top budget/block_size blocks by their key digests, the rest in host memory
    arkvale-bound  arkvale, ranking blocks by the digest's upper bound on q.k
    arkvale-wW  arkvale with bound weight W (0: box centres, 1: the bound; arkvale is W = 0.5)
    arkvale-mM  arkvale swapping a host block in only when it outscores the resident block it
                replaces by more than M logits (arkvale is M = 1); -wW-mM sets both
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SINK_TOKENS = 4          # StreamingLLM's attention sinks
SNAPKV_WINDOW = 32       # observation window (capped at half the smallest layer budget)
SNAPKV_POOL = 7          # max-pooling kernel over neighbouring slots
PYRAMID_RATIO = 3.0      # first layer's budget / last layer's budget
ARKVALE_BOUND_WEIGHT = 0.5   # arkvale's block score: q.centre + this x |q|.half_width of the key box
ARKVALE_RECALL_MARGIN = 1.0   # logits a host block must gain over the resident one it replaces (arkvale.py)
PROBE_STRIDE = 16        # saliency: every 16th prompt position is a probe query (besides the window and decode)


@dataclass(frozen=True)
class BudgetPolicy:
    """A selection rule. ``weights``: whose attention weights the state accumulates
    ("none", "all" queries, the observation "window", or "probe" queries: saliency, see
    ``BudgetState.saliency``); ``evicts_in_prefill``: may
    compact between prefill chunks (else only once every known token is computed)."""

    name: str
    weights: str = "none"
    evicts_in_prefill: bool = False
    is_paged: bool = False
    merges: bool = False
    keeps_blocks: bool = False      # compactions keep whole blocks and write nothing (``BudgetState.choose_blocks``)

    def layer_budgets(self, budget: int, num_layers: int, block_size: int) -> list[int]:
        return [budget] * num_layers

    def window(self, layer_budgets: list[int]) -> int:
        """Recent tokens always kept (and, for snapkv, the observation window)."""
        return min(layer_budgets) // 2

    def keep(self, valid_idx: torch.Tensor, score: torch.Tensor | None, budget: int,
             window: int, num_kv_heads: int) -> torch.Tensor:
        """Slot indices to keep, ascending, one row per KV head: [num_kv_heads, budget].

        ``valid_idx``: the layer's valid slots in position order ([n] > budget);
        ``score``: accumulated attention of those slots ([num_kv_heads, n]) or None.
        """
        raise NotImplementedError


def _top_with_forced(valid_idx: torch.Tensor, score: torch.Tensor, forced: torch.Tensor,
                     budget: int) -> torch.Tensor:
    """``forced`` columns ([n] bool) always kept, the rest filled by highest ``score`` per head."""
    s = score.masked_fill(forced[None, :], float("inf"))
    cols = s.topk(budget, dim=-1).indices.sort(dim=-1).values        # [heads, budget]
    return valid_idx[cols]


class Streaming(BudgetPolicy):
    def keep(self, valid_idx, score, budget, window, num_kv_heads):
        n = valid_idx.shape[0]
        d = valid_idx.device
        cols = torch.cat([torch.arange(SINK_TOKENS, device=d), torch.arange(n - (budget - SINK_TOKENS), n, device=d)])
        return valid_idx[cols].expand(num_kv_heads, budget).contiguous()


class HeavyHitters(BudgetPolicy):
    def keep(self, valid_idx, score, budget, window, num_kv_heads):
        assert score is not None
        n = valid_idx.shape[0]
        forced = torch.arange(n, device=score.device) >= n - window
        return _top_with_forced(valid_idx, score, forced, budget)


class SnapKV(BudgetPolicy):
    def window(self, layer_budgets):
        return min(SNAPKV_WINDOW, min(layer_budgets) // 2)

    def keep(self, valid_idx, score, budget, window, num_kv_heads):
        assert score is not None
        n = valid_idx.shape[0]
        pooled = F.max_pool1d(score[None], SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2)[0]
        forced = torch.arange(n, device=score.device) >= n - window
        return _top_with_forced(valid_idx, pooled, forced, budget)


class Pyramid(SnapKV):
    def layer_budgets(self, budget: int, num_layers: int, block_size: int) -> list[int]:
        # whole blocks: each layer's hole after a compaction is then whole blocks, which the
        # kernels skip (a per-layer block table) instead of masking slot by slot
        return pyramid_budgets(budget, num_layers, block_size)


def pyramid_budgets(budget: int, num_layers: int, unit: int = 1) -> list[int]:
    """Linear from ``2r/(r+1)`` x budget at layer 0 to ``2/(r+1)`` x budget at the last
    (r = PYRAMID_RATIO), in multiples of ``unit`` tokens, summing to ``num_layers * budget``
    rounded down to a multiple of ``unit`` (exactly, for ``unit`` 1; one layer: ``[budget]``). A layer keeps at least
    one unit where ``budget`` is at least two (as ``min_budget`` asks, in blocks)."""
    if num_layers == 1:
        return [budget]
    top, bottom = 2 * PYRAMID_RATIO / (PYRAMID_RATIO + 1), 2 / (PYRAMID_RATIO + 1)
    raw = [budget / unit * (top + (bottom - top) * i / (num_layers - 1)) for i in range(num_layers)]
    out = [int(x) for x in raw]
    # hand the rounding remainder to the layers that lost the most
    order = sorted(range(num_layers), key=lambda i: out[i] - raw[i])
    for i in order[:num_layers * budget // unit - sum(out)]:
        out[i] += 1
    return [x * unit for x in out]


class Merge(HeavyHitters):
    pass


class Saliency(SnapKV):
    """snapkv's rule on saliency: the attention the probe queries gave an entry divided by how
    many probes could see it (ZipCache's normalized attention score: plain sums favour early
    tokens, which every later query sees), max-pooled over neighbouring entries (so a kept token
    keeps its neighbours: measured, without the pooling no passkey survived), plus the recent
    window. ``score`` arrives normalized (``BudgetState.plan``)."""


class SaliencyBlocks(Saliency):
    """Saliency over whole blocks (``BudgetState.choose_blocks``): a block scores its most salient
    slot's saliency, summed over KV heads and averaged over layers; a compaction keeps the first
    block (the sinks), the blocks of the window and the most salient of the rest, ``budget //
    block_size`` in all, and frees the others. No entry moves, so no codec encodes kept KV a second
    time and a shared or cached block stays shared and cached; the choice is one per block for
    every layer and head, coarser than ``saliency``'s per entry."""


@dataclass(frozen=True)
class ArkVale(BudgetPolicy):
    """``bound_weight``: how much of a block's key spread counts in its score; ``recall_margin``:
    by how much (in logits, the 1/sqrt(dim) scale applied) a host block must outscore the resident
    block it would replace before a decode step swaps them (see arkvale.py)."""

    bound_weight: float = ARKVALE_BOUND_WEIGHT
    recall_margin: float = ARKVALE_RECALL_MARGIN

    def window(self, layer_budgets):
        return 0


POLICIES: dict[str, BudgetPolicy] = {p.name: p for p in (
    Streaming("streaming", evicts_in_prefill=True),
    HeavyHitters("h2o", weights="all", evicts_in_prefill=True),
    SnapKV("snapkv", weights="window"),
    Pyramid("pyramid", weights="window"),
    Merge("merge", weights="all", evicts_in_prefill=True, merges=True),
    Saliency("saliency", weights="probe"),
    SaliencyBlocks("saliency-blocks", weights="probe", keeps_blocks=True),
    ArkVale("arkvale", is_paged=True),
    ArkVale("arkvale-bound", is_paged=True, bound_weight=1.0),
)}


TUNED_ARKVALE = "arkvale"   # "arkvale-w0.25", "arkvale-m0", "arkvale-w1-m2": arkvale with that bound weight
                            # (in [0, 1]) and recall margin (logits, >= 0); unnamed ones keep arkvale's


def get_policy(name: str) -> BudgetPolicy:
    policy = POLICIES.get(name)
    if policy is None and name.startswith(TUNED_ARKVALE + "-"):
        policy = _tuned_arkvale(name)
    if policy is None:
        raise ValueError(f"unknown KV budget policy {name!r}; choose one of {', '.join(POLICIES)}, "
                         f"or {TUNED_ARKVALE}-w<weight>-m<margin> (either part alone) with a weight from 0 to 1 "
                         f"and a margin >= 0")
    return policy


def _tuned_arkvale(name: str) -> BudgetPolicy | None:
    settings: dict[str, float] = {}
    for part in name[len(TUNED_ARKVALE) + 1:].split("-"):
        if part[:1] not in ("w", "m") or part[:1] in settings:
            return None
        try:
            settings[part[:1]] = float(part[1:])
        except ValueError:
            return None
    weight, margin = settings.get("w", ARKVALE_BOUND_WEIGHT), settings.get("m", ARKVALE_RECALL_MARGIN)
    if not (0.0 <= weight <= 1.0 and 0.0 <= margin < math.inf):
        return None
    return ArkVale(name, is_paged=True, bound_weight=weight, recall_margin=margin)


def min_budget(block_size: int) -> int:
    """The smallest budget: two blocks (a kept block plus room for the window)."""
    return 2 * block_size


def check_budget(budget: int, policy: BudgetPolicy, block_size: int) -> None:
    """Raise ValueError for a budget the policy cannot run under."""
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise ValueError(f"kv_budget must be an integer number of tokens, got {budget!r}")  # noqa: TRY004
    if budget < min_budget(block_size):
        raise ValueError(f"kv_budget {budget} is below the minimum of {min_budget(block_size)} tokens "
                         f"(two blocks of {block_size})")
    if policy.is_paged and budget % block_size:
        raise ValueError(f"the {policy.name} policy keeps whole blocks: kv_budget {budget} must be a "
                         f"multiple of the block size ({block_size})")
