"""The KV storage protocol: what the model runner, the attention path, the KV budgets and
the block mover need from the device's paged keys and values, in any KV format.

One step, seen from the storage:

    runner     planner = storage.planner()
               planner.add(block_ids, first_slot, num_new)     for each scheduled chunk
               planner.overlay([(table position, block id)])   how to read a table's last block
               writes = planner.build()
    attention  storage.write(layer, k, v, writes)               each layer, before its reads
               storage.gather(layer, block_table, overlay)      keys, values in the compute dtype
    runner     storage.finish_step(writes)                      after the forward pass

A *slot* is ``block_id * block_size + offset``: where one token of a request lives. Which
blocks a request holds is the KV manager's business; the storage only holds their bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.kv.residual import ResidualRows
from kvserve.kv.storage.layout import HalfStore, MakeRowWriter

if TYPE_CHECKING:
    from typing import Self

    from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from kvserve.kv.codecs import KVFormat


@dataclass(frozen=True)
class Overlay:
    """Blocks of a gathered block table to read from elsewhere than their stored form
    (a quantized storage's open blocks): flat positions in the table and their rows."""

    positions: torch.Tensor   # [m] indices into block_table.view(-1)
    rows: torch.Tensor        # [m]


@dataclass(frozen=True)
class StepWrites:
    """Where a step's new keys and values go; built by a storage's planner, read by it alone."""

    slots: torch.Tensor             # [num_tokens] per new token, its cache slot (block_id * block_size + offset)
    encode_rows: torch.Tensor       # [n] residual rows holding blocks the step fills, to encode (else empty)
    encode_block_ids: torch.Tensor  # [n] those blocks' ids
    residual_slots: torch.Tensor | None = None  # [num_tokens] row * block_size + offset, where a half
                                                # keeps residual rows (codecs that encode whole blocks)
    kept_block_ids: tuple[int, ...] = ()        # encoded blocks that keep their rows: they hold drafted
                                                # tokens (the KV manager releases them once accepted)
    refine_rows: torch.Tensor | None = None     # [r] the rows among encode_rows whose blocks get a finer copy
    refine_slots: torch.Tensor | None = None    # [r] ... and its side slot (kv/storage/zip.py)


class WritePlanner(ABC):
    """One step's writes, added chunk by chunk (CPU lists until ``build``)."""

    @abstractmethod
    def add(self, block_ids: list[int], first_slot: int, num_new: int, num_drafted: int = 0) -> None:
        """``num_new`` tokens of one request going to its slots ``first_slot, ...``, where slot
        s lies in block ``block_ids[s // block_size]``, the last ``num_drafted`` of them drafted
        (kvserve/speculative/). May take storage-side room (a residual row) for the blocks they touch;
        ``finish_step`` or the KV manager gives it back (a block that holds drafted tokens keeps
        its row until they are checked: ``KVCacheManager.release_unused_blocks``)."""

    @abstractmethod
    def overlay(self, last_blocks: Sequence[tuple[int, int]]) -> Overlay | None:
        """How to read gathered block tables whose last entry may be a block still open after
        this step. ``last_blocks``: per table, (flat index of its last entry, that block's id).
        None when every block is read as stored."""

    @abstractmethod
    def open_rows(self, last_block_ids: Sequence[int]) -> list[int]:
        """For each block id, the residual row that holds it after this step (it was left
        open, in a storage that keeps rows), or -1: what a kernel's ``PagedBatch.open_rows``
        takes."""

    @abstractmethod
    def build(self) -> StepWrites:
        """The step's writes as tensors on the storage's device."""


class KVStorage(ABC):
    """The keys and values of every layer, in ``num_blocks`` blocks of ``block_size`` tokens.

    Reads (``gather``) come back in ``dtype``, the compute dtype. ``residual`` is the
    storage's per-block bookkeeping that outlives a step (rows of open blocks); the KV
    manager releases a block's share of it when a request frees the block.
    """

    # (traits of a storage class; an instance that stands for another storage takes that one's)
    #: A gather returns exactly what was written, so a chunk with no cached context may
    #: attend to its own new keys and values instead of reading them back.
    reads_as_written: bool = False
    #: KV budgets can run here: entries can be rewritten at any slot (compaction) and whole
    #: blocks of a layer read and written as they are (ArkVale's recalls).
    supports_budgets: bool = False
    #: A block as ArkVale stashes it (``stored_blocks``, ``swap_blocks``) is its keys and values
    #: in the compute dtype; else the storage's own bytes.
    stashes_decoded: bool = True

    num_layers: int
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    residual: ResidualRows

    @classmethod
    @abstractmethod
    def build(cls, model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
              dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None = None) -> Self:
        """Storage for ``fmt``: ``cache.num_blocks`` blocks, or as many as ``cache.memory_bytes``
        holds after whatever the storage must reserve for ``scheduler``'s limits. Raises
        ValueError, with what to change, when not one block fits. ``make_writer``: where it
        gives a writer, new rows go through it instead of the torch path."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Device bytes held, reserves included."""

    @abstractmethod
    def block_tensors(self) -> list[torch.Tensor]:
        """Per-block tensors (each ``[num_blocks, ...]``, views of the storage) in payload
        order: what a block's bytes are between tiers (kv/block_io.py)."""

    @abstractmethod
    def planner(self) -> WritePlanner:
        """A fresh planner for one step's writes."""

    @abstractmethod
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        """Store the step's new ``key``/``value`` ([num_tokens, heads, dim]) of ``layer``."""

    def step_writer(self, writes: StepWrites) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """``write`` with the step's plan bound, for a loop over the layers: (layer, key, value)."""
        return lambda layer, key, value: self.write(layer, key, value, writes)

    @abstractmethod
    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks in ``block_table`` ([B, nb] block ids) as
        [B, nb * block_size, heads, dim] in ``dtype``, tokens in order; ``overlay`` (from this
        step's planner) says where open blocks are read from."""

    def gather_keys(self, layer: int, block_table: torch.Tensor, overlay: Overlay | None = None) -> torch.Tensor:
        """The keys alone of ``gather`` (what scoring attention weights reads)."""
        return self.gather(layer, block_table, overlay)[0]

    def open_overlay(self, block_ids: Sequence[int]) -> Overlay | None:
        """Between steps: where the open blocks among ``block_ids`` (one table) are read from,
        for ``gather``; None where every block is read as stored."""
        return None

    @abstractmethod
    def half_stores(self, layer: int) -> tuple[HalfStore, HalfStore]:
        """Keys and values of ``layer`` as an attention kernel reads them in place: each
        half's layout, part tensors and residual rows (views of the storage). The same two
        objects every call, so a backend may keep what it derives from them."""

    def finish_step(self, writes: StepWrites) -> None:
        """The forward pass that wrote ``writes`` is done (release what it held)."""

    # -- for KV budgets (``supports_budgets``) -----------------------------
    def write_slots(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``key``/``value`` ([n, heads, dim]) at ``slots`` ([n]) of ``layer``."""
        raise NotImplementedError(f"{type(self).__name__} cannot rewrite entries (no KV budgets)")

    def reopen(self, block_id: int) -> None:
        """A compaction leaves ``block_id`` a request's open block again (its first slots
        rewritten, the rest to come): a storage that keeps open blocks apart takes a place for it
        before the rewrite (nothing here)."""

    def read_block(self, layer: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one block of ``layer`` ([block_size, heads, dim]), as views (a
        storage whose blocks are stored as they are; the default ``stored_blocks`` and
        ``swap_blocks`` go through it and ``write_block``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read blocks as stored (no KV budgets)")

    def write_block(self, layer: int, block_id: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Overwrite one block of ``layer`` with ``key``/``value`` ([block_size, heads, dim])."""
        raise NotImplementedError(f"{type(self).__name__} cannot write blocks as stored (no KV budgets)")

    def layer_parts(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Each half of ``layer`` as its per-block tensors ([num_blocks, ...] each, views of the
        storage), whose bytes for one block, in order, are its ``stored_blocks`` row: for copying
        whole blocks in place (ArkVale's C++ swaps); None where they cannot be."""
        return None

    def stored_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of blocks ``block_ids`` ([m]) of ``layer`` as a host store keeps them, one row
        per block and half: keys and values [m, block_size, heads, dim] (``stashes_decoded``)
        or the storage's bytes."""
        old = [self.read_block(layer, int(b)) for b in block_ids.tolist()]
        return torch.stack([k for k, _ in old]), torch.stack([v for _, v in old])

    def swap_blocks(self, layer: int, block_ids: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace blocks ``block_ids`` ([m]) of ``layer`` with ``key``/``value`` (as
        ``stored_blocks`` gives them); returns what they held (``stored_blocks``). One read and
        one write of all ``m`` (ArkVale's recalls)."""
        out_k, out_v = self.stored_blocks(layer, block_ids)
        for i, b in enumerate(block_ids.tolist()):
            self.write_block(layer, b, key[i], value[i])
        return out_k, out_v
