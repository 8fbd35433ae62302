"""The block pool: ref counts, the free queue (which is also the LRU order) and the
map from content key to cached block.

A block is in exactly one of three states:

    used    ref_count > 0, not in the free queue (it may also be cached)
    cached  ref_count == 0, has a key, in the free queue (a hit until reused)
    free    ref_count == 0, no key, in the free queue

``free + cached + used == num_blocks`` always; ``check_integrity`` proves it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


@dataclass(eq=False)
class Block:
    """One physical KV block. Only the pool mutates it."""

    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    token_ids: tuple[int, ...] = ()
    # intrusive links of the free queue; None when not queued (or at an end)
    prev_free: Block | None = None
    next_free: Block | None = None

    @property
    def is_cached(self) -> bool:
        return self.key is not None

    def __repr__(self) -> str:
        key = self.key.hex()[:8] if self.key else None
        return f"Block(id={self.block_id}, ref={self.ref_count}, key={key})"


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_count 0, least recently freed first.

    Removal from the middle is O(1): a cached block that gets hit again leaves the
    queue without a scan. Two sentinels keep the link code free of None checks.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(block_id=-1)
        self._tail = Block(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise NoFreeBlocksError("the free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def append(self, block: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns every block of one KV cache.

    Verbs: ``allocate`` takes blocks from the head of the free queue (evicting their
    cached keys), ``touch`` takes a reference on cached blocks found by a prefix match,
    ``free`` drops references (a block whose count reaches 0 goes to the tail of the
    free queue, keeping its key), ``cache`` gives a full block its content key.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.num_evicted_blocks = 0
        self.peak_num_used = 0          # high-water mark of referenced blocks (see reset_peak)

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free plus evictable cached)."""
        return self.free_queue.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, key: bytes, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for ``key`` if its stored tokens equal ``token_ids``.

        Comparing the tokens makes a hash collision a miss, never wrong keys.
        """
        block = self._cached.get(key)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def peek_evictions(self, num_blocks: int) -> list[Block]:
        """The cached blocks that ``allocate(num_blocks)`` would evict, in eviction order.

        Lets a caller copy them out (demote them to a slower tier) before they are
        overwritten. Walks at most ``num_blocks`` entries of the free queue; changes nothing.
        """
        out = []
        for i, block in enumerate(self.free_queue):
            if i >= num_blocks:
                break
            if block.key is not None:
                out.append(block)
        return out

    # -- verbs -------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` blocks (ref_count 1 each), evicting LRU cached ones."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        self._note_usage()
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
        self._note_usage()

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a request's blocks tail first, so its last blocks reach the
        free queue (and so eviction) before the shared head of the prefix.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def cache(self, block: Block, key: bytes, token_ids: tuple[int, ...]) -> bool:
        """Register a full block under its content key.

        Returns False when another block already holds the key (two requests
        computed the same block at once); this block then stays uncached and is
        simply freed later. Callers may ignore the result: both outcomes are valid.
        """
        if block.key is not None:
            if block.key != key:
                raise ValueError(f"{block} is already cached under another key")
            return True
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"only full blocks are cached: got {len(token_ids)} tokens, block_size {self.block_size}")
        if key in self._cached:
            return False
        block.key = key
        block.token_ids = token_ids
        self._cached[key] = block
        return True

    def evict_all_cached(self) -> int:
        """Forget every cached key of unreferenced blocks (a cache reset)."""
        dropped = 0
        for block in self.free_queue:
            if block.key is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def reset_peak(self) -> None:
        """Start a new high-water mark from the blocks in use now."""
        self.peak_num_used = 0
        self._note_usage()

    def _note_usage(self) -> None:
        self.peak_num_used = max(self.peak_num_used, self.num_blocks - self.free_queue.num_blocks)

    def _evict(self, block: Block) -> None:
        if block.key is None:
            return
        del self._cached[block.key]
        block.key = None
        block.token_ids = ()
        self.num_evicted_blocks += 1

    # -- checks ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        queued = list(self.free_queue)
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued) == self.free_queue.num_blocks, "free queue corrupt"
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count == 0 for b in queued), "a referenced block is in the free queue"
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(queued) == self.num_blocks, (
            f"used {len(used)} + queued {len(queued)} != total {self.num_blocks}")
        for key, block in self._cached.items():
            assert block.key == key, f"{block} indexed under a key it does not hold"
            assert len(block.token_ids) == self.block_size, f"{block} cached while not full"
        assert sum(b.key is not None for b in self.blocks) == len(self._cached), "stray keys"
