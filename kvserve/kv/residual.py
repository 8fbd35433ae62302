"""Full-precision rows for the open blocks of a quantized KV cache (KIVI's residual).

Under a quantized format a block is encoded only once it is full; until then its
tokens live in a *residual row* of the same shape in the compute dtype. This
index maps block ids to rows. It is CPU-side bookkeeping; the tensors live in
the cache. A row is taken when a step first writes into a block and given back
when the block is encoded (full) or freed while still open.

How many rows: a scheduled chunk of n tokens touches at most ``n / block_size + 2``
blocks (its first may be partly filled, its last left open), and a running request
that is not scheduled holds one open block; so a step never needs more than
``num_residual_rows`` rows.
"""

from __future__ import annotations

from collections.abc import Iterable

ROWS_FORMULA = "max_num_batched_tokens // block_size + 2 * max_num_seqs + 1"


def num_residual_rows(block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Rows for every block a step can fill or leave open (``ROWS_FORMULA``)."""
    return max_num_batched_tokens // block_size + 2 * max_num_seqs + 1


class ResidualRows:
    def __init__(self, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows = num_rows
        self._rows: dict[int, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))   # pop() hands out row 0 first

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def assign(self, block_id: int) -> int:
        """The block's row, taking a free one the first time."""
        row = self._rows.get(block_id)
        if row is None:
            if not self._free:
                raise RuntimeError(
                    f"all {self.num_rows} residual rows are in use; this is a sizing bug "
                    f"(rows = {ROWS_FORMULA})")
            row = self._free.pop()
            self._rows[block_id] = row
        return row

    def row_of(self, block_id: int) -> int | None:
        """The block's row, None when it has none (closed, or never written)."""
        return self._rows.get(block_id)

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            row = self._rows.pop(block_id, None)
            if row is not None:
                self._free.append(row)

    def borrow(self, n: int) -> list[int]:
        """Up to ``n`` free rows for scratch (a budget's rewrite, between steps), no block's;
        ``give_back`` returns them."""
        return [self._free.pop() for _ in range(min(n, len(self._free)))]

    def give_back(self, rows: list[int]) -> None:
        self._free.extend(reversed(rows))

    def renew(self, block_ids: Iterable[int]) -> None:
        """The blocks are handed out again: what the storage kept for their old content goes
        (nothing here; a zip storage's finer copies, kv/storage/zip.py)."""

    def check_integrity(self) -> None:
        used = set(self._rows.values())
        assert len(used) == len(self._rows), "two blocks share a residual row"
        assert not used & set(self._free), "a row is both used and free"
        assert len(used) + len(self._free) == self.num_rows, "residual rows leaked"


class NoResidual(ResidualRows):
    """The null object for lossless formats: blocks are stored as written."""

    def __init__(self) -> None:
        self.num_rows = 0
        self._rows = {}
        self._free = []

    def assign(self, block_id: int) -> int:
        raise RuntimeError("a lossless KV format keeps no residual rows")
