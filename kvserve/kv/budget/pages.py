"""ArkVale's choice at a decode step, for one layer: which host blocks come back and which
resident blocks make room for them.

Contract (``PageSelector.swaps``; the C++ build in kvserve/kv/csrc/pages.cpp and the torch
twin ``choose_swaps`` decide alike):

* every full block gets its digest score for the query (``DigestBox``: per query head
  ``q . centre + weight * |q| . half_width``, relative to that head's best block, then the
  block's best head); the first block (the sinks) and the latest full block score +inf, a
  block the host store evicted (``LOST``) or a NaN score -inf;
* the top ``num_top`` blocks (best first, ties to the lower index) are the wanted set;
* the host blocks in it, best first, are paired with the resident blocks outside it, worst
  first; pairs are taken while the incoming block outscores the outgoing one by more than
  ``margin`` (raw q . k units), so a block is not swapped for one barely better (each
  later pair gains less, so the first that fails ends the list).

Scoring 480 blocks for 9 query heads is ~0.5 MFLOP, cheap in any form; what costs is the
dozen small torch calls around it per layer and step (~0.25 ms on a 2-core CPU, 8 ms for
30 layers), hence one C++ call on CPU tensors (torch elsewhere, or when it cannot be built).
"""

from __future__ import annotations

import functools
from types import MappingProxyType, ModuleType

import torch

from kvserve.extensions import CppExtension, load

HOST, RESIDENT, LOST = 0, 1, 2     # ``where`` codes, one uint8 per full block

PAGES = CppExtension(
    prefix="kvserve_cpu_pages",
    sources=("kv/csrc/pages.cpp",),
    isas=MappingProxyType({       # kvserve/csrc/simd.h's two vector builds, and scalar
        "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        "avx2": ("-mavx2", "-mfma", "-mf16c"),
        "scalar": (),
    }),
    cpu_flags=MappingProxyType({
        "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
        "avx2": frozenset({"avx2", "fma", "f16c"}),
    }),
    title="the C++ ArkVale page selection",
    fallback="ranking pages with torch",
)


@functools.cache
def load_extension(isa: str | None = None) -> ModuleType | None:
    return load(PAGES, isa)


class DigestBox:
    """A layer's digests: per channel each block's key box centre, then its half width, as
    float16 [kv_heads, 2 * dim, blocks] (``box``; blocks last, so a product runs along them;
    float16, as ArkVale keeps its digests: half the bytes a decode step reads, each value
    rounded by at most 2^-11 of itself, far inside the spread of a block's keys).

    ``box`` is a view of the first ``num_blocks`` columns of a store with room to grow:
    ``extend`` writes new blocks into the spare columns and returns a longer box over the same
    store (the shorter one still reads its own columns), copying only when the store is full
    or another box already extended this one."""

    def __init__(self, dmin: torch.Tensor, dmax: torch.Tensor, capacity: int = 0) -> None:
        """From the per-channel minimum and maximum keys of each block: [blocks, kv_heads, dim]."""
        columns = self._columns(dmin, dmax)
        kv_heads, rows, num_blocks = columns.shape
        self.store = columns.new_empty((kv_heads, rows, max(capacity, num_blocks)))
        self.store[:, :, :num_blocks] = columns
        self.num_blocks = num_blocks
        self._claimed = [num_blocks]      # columns some box over this store reads (shared by them)

    @staticmethod
    def _columns(dmin: torch.Tensor, dmax: torch.Tensor) -> torch.Tensor:
        lo, hi = dmin.float().permute(1, 2, 0), dmax.float().permute(1, 2, 0)
        return torch.cat([(hi + lo) / 2, (hi - lo) / 2], dim=1).to(torch.float16)

    @property
    def box(self) -> torch.Tensor:
        return self.store[:, :, :self.num_blocks]

    @staticmethod
    def extend(box: DigestBox | None, dmin: torch.Tensor, dmax: torch.Tensor) -> DigestBox:
        """``box`` (None: no blocks yet) followed by the blocks of ``dmin``/``dmax``."""
        if box is None:
            return DigestBox(dmin, dmax)
        num_new = dmin.shape[0]
        total = box.num_blocks + num_new
        if box._claimed[0] != box.num_blocks or total > box.store.shape[2]:
            grown = DigestBox(dmin[:0], dmax[:0], capacity=2 * total)
            grown.store[:, :, :box.num_blocks] = box.box
            grown.num_blocks = grown._claimed[0] = box.num_blocks
            box = grown
        new = object.__new__(DigestBox)
        new.store, new._claimed, new.num_blocks = box.store, box._claimed, total
        new.store[:, :, box.num_blocks:total] = DigestBox._columns(dmin, dmax)
        box._claimed[0] = total
        return new

    def scores(self, q: torch.Tensor, weight: float) -> torch.Tensor:
        """Every block's score for ``q`` [heads, dim] -> [blocks]: one batched product."""
        kv_heads = self.box.shape[0]
        qg = q.float().view(kv_heads, -1, q.shape[-1])                          # [kv, group, dim]
        s = torch.bmm(torch.cat([qg, weight * qg.abs()], dim=-1), self.box.float())   # [kv, group, blocks]
        s = s.flatten(0, 1)                                                     # [heads, blocks]
        return (s - s.max(dim=1, keepdim=True).values).max(dim=0).values


def choose_swaps(score: torch.Tensor, where: torch.Tensor, num_top: int, margin: float) -> list[tuple[int, int]]:
    """The torch twin of the C++ choice, from each block's digest score (see the module)."""
    s = score.float().clone()
    s[(where.to(s.device) == LOST) | s.isnan()] = float("-inf")
    s[0] = s[-1] = float("inf")
    order = torch.sort(s, descending=True, stable=True).indices.tolist()
    at = where.tolist()
    coming = [b for b in order[:num_top] if at[b] == HOST]
    going = [b for b in reversed(order[num_top:]) if at[b] == RESIDENT]
    values = s.tolist()
    pairs = []
    for j_in, j_out in zip(coming, going):
        if not values[j_in] - values[j_out] > margin:
            break
        pairs.append((j_in, j_out))
    return pairs


class PageSelector:
    """``swaps`` by the C++ build for CPU tensors where it builds, else by torch."""

    def __init__(self, device: torch.device, use_extension: bool = True) -> None:
        self._ext = load_extension() if use_extension and device.type == "cpu" else None

    @property
    def is_native(self) -> bool:
        return self._ext is not None

    @property
    def native(self) -> ModuleType | None:
        """The C++ build, where it is used."""
        return self._ext

    def scores(self, box: DigestBox, q: torch.Tensor, weight: float) -> torch.Tensor:
        """``box.scores(q, weight)``."""
        if self._ext is None:
            return box.scores(q, weight)
        return self._ext.digest_scores(box.store, box.num_blocks, q.float().contiguous(), weight)

    def swaps(self, box: DigestBox, q: torch.Tensor, weight: float, where: torch.Tensor, num_top: int,
              margin: float) -> list[tuple[int, int]]:
        if self._ext is None:
            return choose_swaps(box.scores(q, weight), where, num_top, margin)
        pairs = self._ext.select_pages(box.store, box.num_blocks, q.float().contiguous(), weight, where, num_top,
                                       margin)
        return [(int(a), int(b)) for a, b in pairs.tolist()]
