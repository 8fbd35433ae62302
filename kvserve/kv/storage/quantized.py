"""KV storage through a codec, quantized as it is written where the codec allows it.

Per layer and half (K, V): one tensor per codec part, ``[num_blocks, *part.shape]``.

Most codecs store each token on its own (int8, fp8, fp16/bf16, int4, KIVI's values, and
``+had`` over them): a step encodes its new tokens and writes them straight into their
blocks, open or not. A codec that *encodes whole blocks* (KIVI's keys: statistics over the
block's tokens; ``+outN``) cannot: its half keeps residual rows ``[num_rows, block_size,
heads, dim]`` in the compute dtype, a step writes its new tokens there, encodes the blocks
it filled, and reads lay the rows of still-open blocks over the decoded ones. Only such
halves have rows, so a KIVI cache reserves rows for its keys alone, and int8 none at all.

Attention reads what is stored, for old and new tokens alike, so a prefix-cache hit sees
exactly what a cold run saw. On the CPU a layer's write is one C++ call for both halves
(attention/cpu_writes.py, handed in by the engine's wiring), byte for byte the torch path
below, which stays the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.kv.block_io import block_nbytes, read_blocks, write_blocks
from kvserve.kv.residual import NoResidual, ResidualRows, num_residual_rows
from kvserve.kv.storage.base import KVStorage, Overlay, StepWrites, WritePlanner
from kvserve.kv.storage.layout import HalfLayout, HalfStore, MakeRowWriter

if TYPE_CHECKING:
    from typing import Self

    from kvserve.kv.codecs import HalfCodec, KVFormat, LayerFormat


class QuantizedKVCache(KVStorage):
    """``StepWrites.slots`` are cache slots (per-token halves); ``residual_slots`` rows of
    halves that encode whole blocks, whose filled blocks are encoded from their rows, which
    ``finish_step`` then frees."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
                 num_residual_rows: int, dtype: torch.dtype, device: torch.device, *,
                 make_writer: MakeRowWriter | None = None) -> None:
        """``make_writer``: a faster writer where it runs (the engine gives the C++ encoders: CPU,
        extension built); None or its None keeps the torch path (the reference)."""
        if len(fmt.layers) != config.num_layers:
            raise ValueError(f"KV format has {len(fmt.layers)} layers, the model {config.num_layers}")
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = fmt
        self.dtype = dtype
        self.device = device
        self.residual = self.make_residual(num_residual_rows) if self.keeps_residual(fmt) else NoResidual()
        h, d = config.num_kv_heads, config.head_dim
        self.key_parts, self.value_parts = layer_parts(fmt.layers, num_blocks, block_size, h, d, device)
        for lf in fmt.layers:
            for codec in (lf.key, lf.value):
                if not codec.encodes_whole_blocks:
                    _check_token_parts(codec, block_size, h, d)
        shape = (self.residual.num_rows, block_size, h, d)

        def rows(codec: HalfCodec) -> torch.Tensor | None:
            return torch.zeros(shape, dtype=dtype, device=device) if fmt.keeps_rows(codec) else None

        self.key_residual = [rows(lf.key) for lf in fmt.layers]
        self.value_residual = [rows(lf.value) for lf in fmt.layers]
        self.key_layouts = [HalfLayout.from_codec(lf.key) for lf in fmt.layers]
        self.value_layouts = [HalfLayout.from_codec(lf.value) for lf in fmt.layers]
        self._halves = [(HalfStore(self.key_layouts[i], self.key_parts[i], self.key_residual[i]),
                         HalfStore(self.value_layouts[i], self.value_parts[i], self.value_residual[i]))
                        for i in range(len(fmt.layers))]
        self._writer = make_writer(device, self._halves, d) if make_writer is not None else None
        # the bytes of one block and half as a host store keeps it (``stored_blocks``): the largest
        # half of any layer (the others padded with zeros), so every stashed block has one shape
        self.stash_nbytes = max(block_nbytes(list(store.values())) for store in self.key_parts + self.value_parts)

    @staticmethod
    def keeps_residual(fmt: KVFormat) -> bool:
        return any(fmt.keeps_rows(c) for lf in fmt.layers for c in (lf.key, lf.value))

    def make_residual(self, num_rows: int) -> ResidualRows:
        return ResidualRows(num_rows)

    #: what the reserved rows hold, for the error when they do not fit
    rows_hold: ClassVar[str] = "of the halves that encode whole blocks"

    @classmethod
    def build(cls, model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
              dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None = None) -> Self:
        """The residual rows are reserved out of the memory first (kv/residual.py says how many)."""
        bs = cache.block_size
        num_rows = num_residual_rows(bs, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        reserved = num_rows * cls.reserved_nbytes_per_row(model, fmt, bs, dtype)
        per_block = fmt.nbytes_per_block(bs, model.num_kv_heads, model.head_dim)
        if cache.num_blocks is None and reserved + per_block > cache.memory_bytes:
            raise ValueError(
                f"KV format {fmt.spec} keeps {num_rows} full-precision residual rows {cls.rows_hold} ({reserved} "
                f"bytes: one open block per running request plus the blocks a step fills), more than the KV cache "
                f"memory ({cache.memory_bytes} bytes); lower max_num_seqs ({scheduler.max_num_seqs}) or "
                f"max_num_batched_tokens ({scheduler.max_num_batched_tokens}), or give the KV cache more memory")
        num_blocks = cache.resolve_num_blocks(per_block, reserved)
        return cls.sized(model, fmt, num_blocks, num_rows, bs, dtype, device, make_writer)

    @classmethod
    def reserved_nbytes_per_row(cls, model: ModelConfig, fmt: KVFormat, block_size: int, dtype: torch.dtype) -> int:
        """What ``build`` reserves for each residual row."""
        return cls.residual_row_nbytes(model, fmt, block_size, dtype)

    @classmethod
    def sized(cls, model: ModelConfig, fmt: KVFormat, num_blocks: int, num_rows: int, block_size: int,
              dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None) -> Self:
        """The storage ``build`` sized."""
        return cls(model, num_blocks, block_size, fmt, num_rows, dtype, device, make_writer=make_writer)

    @staticmethod
    def residual_row_nbytes(config: ModelConfig, fmt: KVFormat, block_size: int, dtype: torch.dtype) -> int:
        """One row: a block of every half that keeps rows, in the compute dtype."""
        num_halves = sum(fmt.keeps_rows(c) for lf in fmt.layers for c in (lf.key, lf.value))
        element = torch.empty((), dtype=dtype).element_size()
        return num_halves * block_size * config.num_kv_heads * config.head_dim * element

    def block_tensors(self) -> list[torch.Tensor]:
        """Per layer, the key parts then the value parts, each in the codec's part order."""
        out: list[torch.Tensor] = []
        for kp, vp in zip(self.key_parts, self.value_parts):
            out.extend(kp.values())
            out.extend(vp.values())
        return out

    @property
    def nbytes(self) -> int:
        parts = [t for store in self.key_parts + self.value_parts for t in store.values()]
        rows = [t for t in self.key_residual + self.value_residual if t is not None]
        return sum(t.numel() * t.element_size() for t in parts + rows)

    def planner(self) -> WritePlanner:
        return _QuantizedPlanner(self.residual, self.block_size, self.device)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        if self._writer is not None:
            self._writer.write(layer, key, value, writes.slots, writes.residual_slots, writes.encode_rows,
                                   writes.encode_block_ids)
            return
        self._write_torch(layer, key, value, writes)

    def step_writer(self, writes: StepWrites) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        if self._writer is None:
            return super().step_writer(writes)
        return self._writer.bind(writes.slots, writes.residual_slots, writes.encode_rows, writes.encode_block_ids)

    def _write_torch(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        """The reference: each half through its codec and ``index_copy_``."""
        lf = self.format.layers[layer]
        for x, residual, codec, store in ((key, self.key_residual[layer], lf.key, self.key_parts[layer]),
                                          (value, self.value_residual[layer], lf.value, self.value_parts[layer])):
            if residual is None:
                # one token is a block of one: a per-token codec stores it exactly as in a full block
                encoded = codec.encode(x.unsqueeze(1))
                for name, part in encoded.items():
                    stored = store[name]
                    stored.view(-1, *stored.shape[2:]).index_copy_(0, writes.slots, part.squeeze(1))
                continue
            assert writes.residual_slots is not None
            residual.view(-1, *x.shape[1:]).index_copy_(0, writes.residual_slots, x.to(residual.dtype))
            if writes.encode_rows.numel():
                encoded = codec.encode(residual.index_select(0, writes.encode_rows))
                for name, part in encoded.items():
                    store[name].index_copy_(0, writes.encode_block_ids, part)

    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lf = self.format.layers[layer]
        flat = block_table.reshape(-1)
        out: list[torch.Tensor] = []
        for codec, store, residual in ((lf.key, self.key_parts[layer], self.key_residual[layer]),
                                       (lf.value, self.value_parts[layer], self.value_residual[layer])):
            blocks = codec.decode({name: t.index_select(0, flat) for name, t in store.items()}, self.dtype)
            if residual is not None and overlay is not None and overlay.positions.numel():
                blocks[overlay.positions] = residual.index_select(0, overlay.rows)
            out.append(blocks.view(block_table.shape[0], -1, *blocks.shape[2:]))
        return out[0], out[1]

    def half_stores(self, layer: int) -> tuple[HalfStore, HalfStore]:
        return self._halves[layer]

    def open_overlay(self, block_ids: Sequence[int]) -> Overlay | None:
        """Between steps a block with a residual row is open (the rows of the blocks a step
        fills are freed when it ends): it is read from its row."""
        hits = [(i, row) for i, b in enumerate(block_ids) if (row := self.residual.row_of(b)) is not None]
        if not hits:
            return None
        return Overlay(torch.tensor([i for i, _ in hits], dtype=torch.long, device=self.device),
                       torch.tensor([r for _, r in hits], dtype=torch.long, device=self.device))

    # -- for KV budgets ----------------------------------------------------------
    supports_budgets = True

    def write_slots(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """A budget's rewrite (a compaction, ArkVale's recalls): entries at any cache slots (each
        at most once), through the codecs. A half that stores tokens on their own encodes each
        into its slot. A half that encodes whole blocks writes the entries of an open block (one
        with a residual row: ``reopen``) into its row, and encodes every other block the slots
        touch again: from the entries alone where they fill it, else laid over its decoded
        tokens (which its other slots keep; the budgets write whole blocks, or a block's front
        with the rest copies). Through the C++ writer where the storage has one (closed blocks
        in free residual rows borrowed for the write), else the codecs' torch path."""
        if self._writer is not None and self._write_slots_native(layer, key, value, slots):
            return
        lf = self.format.layers[layer]
        bs = self.block_size
        blocks: torch.Tensor | None = None
        for x, residual, codec, store in ((key, self.key_residual[layer], lf.key, self.key_parts[layer]),
                                          (value, self.value_residual[layer], lf.value, self.value_parts[layer])):
            x = x.to(self.dtype)
            if residual is None:
                for name, part in codec.encode(x.unsqueeze(1)).items():
                    stored = store[name]
                    stored.view(-1, *stored.shape[2:]).index_copy_(0, slots, part.squeeze(1))
                continue
            if blocks is None:      # (the same for both halves)
                blocks, index = (slots // bs).unique(return_inverse=True)     # sorted
                rows = [self.residual.row_of(b) for b in blocks.tolist()]
                open_block = torch.tensor([r is not None for r in rows], dtype=torch.bool, device=slots.device)
                block_row = torch.tensor([-1 if r is None else r for r in rows], dtype=torch.long, device=slots.device)
                in_row = open_block[index]
                closed_blocks = blocks[~open_block]
                # each closed block's place among them, and how many of its slots are written
                place = torch.cumsum(~open_block, 0) - 1
                closed_at = place[index[~in_row]] * bs + slots[~in_row] % bs
                filled = torch.bincount(place[index[~in_row]], minlength=closed_blocks.numel()) == bs
            if bool(in_row.any()):
                at = block_row[index[in_row]] * bs + slots[in_row] % bs
                residual.view(-1, *x.shape[1:]).index_copy_(0, at, x[in_row])
            if not closed_blocks.numel():
                continue
            content = x.new_empty(closed_blocks.numel(), bs, *x.shape[1:])
            partial = (~filled).nonzero().flatten()
            if partial.numel():
                content[partial] = codec.decode({name: t.index_select(0, closed_blocks[partial])
                                                 for name, t in store.items()}, self.dtype)
            content.view(-1, *x.shape[1:]).index_copy_(0, closed_at, x[~in_row])
            for name, part in codec.encode(content).items():
                store[name].index_copy_(0, closed_blocks, part)

    def _write_slots_native(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> bool:
        """``write_slots`` through the C++ writer, as a step's writes go: per-token halves into
        their slots; for halves that encode whole blocks, an open block's entries into its row and
        every closed block the slots touch through a borrowed row (its decoded tokens there first
        where the entries do not fill it), encoded into the block, as many blocks a call as rows
        are free. False, writing nothing, where no row is free."""
        assert self._writer is not None
        if not self.residual.num_rows:
            self._writer.write(layer, key, value, slots)
            return True
        bs = self.block_size
        blocks, index = (slots // bs).unique(return_inverse=True)
        open_rows = [self.residual.row_of(b) for b in blocks.tolist()]
        closed = [i for i, r in enumerate(open_rows) if r is None]
        lent = self.residual.borrow(len(closed))
        if closed and not lent:
            return False
        try:
            counts = torch.bincount(index, minlength=blocks.numel()).tolist()
            # one call per group of closed blocks (as many as rows were lent); the first also
            # writes the open blocks' entries
            groups = [closed[i:i + len(lent)] for i in range(0, len(closed), len(lent))] if closed else [[]]
            for n, group in enumerate(groups):
                block_row = torch.tensor([r if r is not None and n == 0 else -1 for r in open_rows], dtype=torch.long)
                block_row[group] = torch.tensor(lent[:len(group)], dtype=torch.long)
                partial = [i for i in group if counts[i] < bs]
                if partial:
                    self._decode_into_rows(layer, blocks[partial], block_row[partial])
                mine = block_row[index] >= 0
                at = block_row[index[mine]] * bs + slots[mine] % bs
                self._writer.write(layer, key[mine], value[mine], slots[mine], at, block_row[group], blocks[group])
            return True
        finally:
            self.residual.give_back(lent)

    def _decode_into_rows(self, layer: int, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The blocks' decoded tokens into residual rows ``rows`` of the halves that keep rows."""
        lf = self.format.layers[layer]
        for residual, codec, store in ((self.key_residual[layer], lf.key, self.key_parts[layer]),
                                       (self.value_residual[layer], lf.value, self.value_parts[layer])):
            if residual is not None:
                decoded = codec.decode({name: t.index_select(0, block_ids) for name, t in store.items()}, self.dtype)
                residual.index_copy_(0, rows, decoded)

    def reopen(self, block_id: int) -> None:
        if self.residual.num_rows:
            self.residual.assign(block_id)

    stashes_decoded = False

    def stored_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each half's parts as bytes (a block's payload between tiers, kv/block_io.py), one uint8
        row of ``stash_nbytes`` per block (then zeros): what ArkVale stashes, so a block comes
        back exactly as it left. A block still open (its tokens in a residual row) has no stored
        form yet."""
        ids = block_ids.tolist()
        assert all(self.residual.row_of(b) is None for b in ids), "an open block is stashed"
        k, v = (read_blocks(parts, ids) for parts in self.layer_parts(layer))
        return (F.pad(k, (0, self.stash_nbytes - k.shape[1])), F.pad(v, (0, self.stash_nbytes - v.shape[1])))

    def layer_parts(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.key_parts[layer].values()), list(self.value_parts[layer].values())

    def swap_blocks(self, layer: int, block_ids: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes in, bytes out (``stored_blocks``): one copy per part, nothing encoded."""
        old = self.stored_blocks(layer, block_ids)
        ids = block_ids.tolist()
        for parts, data in zip(self.layer_parts(layer), (key, value)):
            write_blocks(parts, ids, data[:, :block_nbytes(parts)])
        return old

    def finish_step(self, writes: StepWrites) -> None:
        # the blocks filled this step are encoded now: their rows are free again (but for blocks
        # holding drafted tokens, which keep theirs until the tokens are checked)
        kept = set(writes.kept_block_ids)
        self.residual.release(b for b in writes.encode_block_ids.tolist() if b not in kept)


def layer_parts(layers: Sequence[LayerFormat], count: int, block_size: int, heads: int, dim: int,
                device: torch.device) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Per layer, zeroed part tensors ``[count, *part.shape]`` of the key codec, then of the value codec."""
    halves: tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] = ([], [])
    for lf in layers:
        for codec, store in zip((lf.key, lf.value), halves):
            store.append({p.name: torch.zeros((count, *p.shape), dtype=p.dtype, device=device)
                          for p in codec.parts(block_size, heads, dim)})
    return halves


def _check_token_parts(codec: HalfCodec, block_size: int, heads: int, dim: int) -> None:
    """A per-token codec's parts all lead with the block's tokens, so a token's parts are a
    row of each: what writing token by token relies on."""
    whole = codec.parts(block_size, heads, dim)
    single = codec.parts(1, heads, dim)
    if any(w.shape != (block_size, *s.shape[1:]) or s.shape[0] != 1 for w, s in zip(whole, single)):
        raise ValueError(f"codec {codec.name} stores tokens on their own but its parts do not lead with them")


class _QuantizedPlanner(WritePlanner):
    """Every new token goes to its cache slot (per-token halves); where the storage keeps
    residual rows, every block a chunk touches also gets a row, the blocks it fills are
    encoded, and the block it leaves open is read from its row."""

    def __init__(self, residual: ResidualRows, block_size: int, device: torch.device) -> None:
        self.residual = residual
        self.keeps_rows = residual.num_rows > 0
        self.block_size = block_size
        self.device = device
        self.slots: list[int] = []
        self.residual_slots: list[int] = []
        self.encode_rows: list[int] = []
        self.encode_blocks: list[int] = []
        self.open_rows_of: dict[int, int] = {}      # block id -> row, blocks left open by this step
        self.kept_blocks: list[int] = []            # blocks encoded while holding drafted tokens

    def add(self, block_ids: list[int], first_slot: int, num_new: int, num_drafted: int = 0) -> None:
        bs = self.block_size
        start, end = first_slot, first_slot + num_new
        self.slots.extend(block_ids[s // bs] * bs + s % bs for s in range(start, end))
        if not self.keeps_rows:
            return
        rows = {i: self.residual.assign(block_ids[i]) for i in range(start // bs, (end - 1) // bs + 1)}
        self.residual_slots.extend(rows[p // bs] * bs + p % bs for p in range(start, end))
        for i, row in rows.items():
            if (i + 1) * bs <= end:
                self.encode_rows.append(row)
                self.encode_blocks.append(block_ids[i])
                # a block that holds drafted tokens is encoded for this step's reads, as a plain step
                # would; its row stays, so that a rejected draft's slots can be written again and the
                # block encoded again from its accepted rows
                if (i + 1) * bs > end - num_drafted:
                    self.kept_blocks.append(block_ids[i])
        if end % bs:
            self.open_rows_of[block_ids[end // bs]] = rows[end // bs]

    def overlay(self, last_blocks: Sequence[tuple[int, int]]) -> Overlay | None:
        hits = [(position, self.open_rows_of[block]) for position, block in last_blocks if block in self.open_rows_of]
        if not hits:
            return None
        return Overlay(torch.tensor([p for p, _ in hits], dtype=torch.long, device=self.device),
                       torch.tensor([r for _, r in hits], dtype=torch.long, device=self.device))

    def open_rows(self, last_block_ids: Sequence[int]) -> list[int]:
        return [self.open_rows_of.get(block, -1) for block in last_block_ids]

    def build(self) -> StepWrites:
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        residual = tensor(self.residual_slots) if self.keeps_rows else None
        return StepWrites(tensor(self.slots), tensor(self.encode_rows), tensor(self.encode_blocks), residual,
                          tuple(self.kept_blocks))
