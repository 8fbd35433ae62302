"""The block pool: ref counts, the free queue (which is also the LRU order) and the
map from content key to cached block.

A block is in exactly one of three states:

    used    ref_count > 0, not in the free queue (it may also be cached)
    cached  ref_count == 0, has a key, in the free queue (a hit until reused)
    free    ref_count == 0, no key, in the free queue

``free + cached + used == num_blocks`` always; ``check_integrity`` proves it.

Blocks with ref_count 0 wait in one queue per eviction class; ``allocate`` takes from the
first non-empty queue, each in LRU order:

    class 0 (normal)   free blocks, and cached blocks last held by normal requests
    class 1 (high)     cached blocks a ``high`` request held (kvserve/cache_control.py)
    pinned             cached blocks whose key a pin covers (kv/pins.py)

Every verb stays O(1) per block (allocate looks at a fixed number of queue heads). A
block's class is the highest of the requests that held it since it was last free; a
block without a key is always class 0 (it holds nothing worth keeping).

A cached block also records the tenant its key's namespace belongs to (kvserve/cache_control.py),
counted per tenant, so a cache reset can drop one tenant's blocks and leave every other's
(``evict_cached``: one walk of the free queue).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvserve.cache_control import CACHE_PRIORITIES


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free or evictable."""


@dataclass(eq=False)
class Block:
    """One physical KV block. Only the pool mutates it."""

    block_id: int
    ref_count: int = 0
    key: bytes | None = None
    token_ids: tuple[int, ...] = ()
    retention: int = 0              # eviction class of the requests holding it (BlockPool.touch)
    tag: int = 0                    # what its allocation was for (a layer group: kv/groups.py)
    tenant: str = ""                # while cached: the tenant whose namespace its key is in ("" the engine's)
    queue_index: int = 0            # which free queue holds it, while its ref_count is 0
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
        last = self._tail.prev_free
        assert last is not None
        self._insert(block, last, self._tail)

    def appendleft(self, block: Block) -> None:
        first = self._head.next_free
        assert first is not None
        self._insert(block, self._head, first)

    def _insert(self, block: Block, prev: Block, nxt: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_blocks += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class EvictionQueues:
    """The blocks with ref_count 0, one ``FreeBlockQueue`` per eviction class; iteration and
    ``popleft`` go lowest class first, so together they are the eviction order.

    ``append`` puts a block at the tail of its class; ``remove`` finds the block's queue from
    ``block.queue_index``: both O(1). ``popleft`` looks at most at one head per class.
    """

    def __init__(self, blocks: Iterable[Block], num_queues: int) -> None:
        self.queues = [FreeBlockQueue(()) for _ in range(num_queues)]
        self.num_blocks = 0
        for block in blocks:
            self.append(block, 0)

    def popleft(self) -> Block:
        for queue in self.queues:
            if queue.num_blocks:
                self.num_blocks -= 1
                return queue.popleft()
        raise NoFreeBlocksError("the free block queue is empty")

    def remove(self, block: Block) -> None:
        self.queues[block.queue_index].remove(block)
        self.num_blocks -= 1

    def append(self, block: Block, index: int) -> None:
        self.queues[index].append(block)
        block.queue_index = index
        self.num_blocks += 1

    def appendleft(self, block: Block) -> None:
        """To the head of the first queue: the next block ``popleft`` gives."""
        self.queues[0].appendleft(block)
        block.queue_index = 0
        self.num_blocks += 1

    def move(self, block: Block, index: int) -> None:
        """To the tail of queue ``index`` (a block that is already there goes to its tail)."""
        self.remove(block)
        self.append(block, index)

    def __iter__(self) -> Iterator[Block]:
        for queue in self.queues:
            yield from queue

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Owns every block of one KV cache.

    Verbs: ``allocate`` takes blocks from the head of the eviction order (evicting their
    cached keys), ``touch`` takes a reference on cached blocks found by a prefix match,
    ``free`` drops references (a block whose count reaches 0 goes to the tail of its
    class's queue, keeping its key), ``cache`` gives a full block its content key,
    ``pin_keys`` / ``unpin_keys`` count pins on keys (kv/pins.py holds the pins themselves).
    """

    def __init__(self, num_blocks: int, block_size: int, num_classes: int = len(CACHE_PRIORITIES)) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_classes = num_classes
        self.pinned_queue = num_classes          # the last queue: evicted after every class
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = EvictionQueues(self.blocks, num_classes + 1)
        self._cached: dict[bytes, Block] = {}
        self._pin_counts: dict[bytes, int] = {}  # key -> pins covering it
        self._num_cached_by_tenant: dict[str, int] = {}
        self.num_evicted_blocks = 0
        self.num_pinned_cached = 0      # blocks holding a pinned key (used or not)
        self.num_pinned_evicted = 0     # pinned blocks evicted for room (demoted when a tier exists)
        self.peak_num_used = 0          # high-water mark of referenced blocks (see reset_peak)
        self._num_used_by_tag: dict[int, int] = {}    # referenced blocks per allocation tag

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free plus evictable cached)."""
        return self.free_queue.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_pinned_keys(self) -> int:
        """Distinct keys some pin covers, on the device or not."""
        return len(self._pin_counts)

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

    def holds(self, key: bytes) -> bool:
        """Whether a device block holds ``key``."""
        return key in self._cached

    def cached_blocks_by_tenant(self) -> dict[str, int]:
        """Cached blocks (used or not) per tenant holding any ("" the engine's own namespace)."""
        return dict(self._num_cached_by_tenant)

    def cached_keys(self) -> list[bytes]:
        """Every key a device block holds, oldest cached first (what a cluster's router indexes)."""
        return list(self._cached)

    def is_pinned(self, block: Block) -> bool:
        return block.key is not None and block.key in self._pin_counts

    def pin_count(self, key: bytes) -> int:
        """How many pins cover ``key``."""
        return self._pin_counts.get(key, 0)

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
    def num_used_by_tag(self, tag: int) -> int:
        """Referenced blocks allocated with ``tag``."""
        return self._num_used_by_tag.get(tag, 0)

    def allocate(self, num_blocks: int, retention: int = 0, tag: int = 0) -> list[Block]:
        """Take ``num_blocks`` blocks (ref_count 1 each) for a request of class ``retention``,
        evicting cached ones in eviction order; ``tag`` says what for (counted while they are used)."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, only {self.num_free_blocks} are free")
        self._check_class(retention)
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            block.retention = retention
            block.tag = tag
            out.append(block)
        self._num_used_by_tag[tag] = self._num_used_by_tag.get(tag, 0) + num_blocks
        self._note_usage()
        return out

    def touch(self, blocks: Iterable[Block], retention: int = 0) -> None:
        """Take one more reference on each block (a prefix-cache hit) for a request of class
        ``retention``; a block's class becomes the highest of its holders'."""
        self._check_class(retention)
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
                block.retention = retention
                self._num_used_by_tag[block.tag] = self._num_used_by_tag.get(block.tag, 0) + 1
            else:
                block.retention = max(block.retention, retention)
            block.ref_count += 1
        self._note_usage()

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given.

        Callers pass a request's blocks tail first, so its last blocks reach the
        free queue (and so eviction) before the shared head of the prefix. A block with no
        key (never filled, or holding KV no prefix may reuse) goes to the head of the queue
        instead: reusing it evicts nothing.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_used_by_tag[block.tag] -= 1
            if block.ref_count == 0 and block.key is None:
                self.free_queue.appendleft(block)     # holds nothing to find again: reused first
            elif block.ref_count == 0:
                self.free_queue.append(block, self._queue_of(block))

    def cache(self, block: Block, key: bytes, token_ids: tuple[int, ...], tenant: str = "") -> bool:
        """Register a full block under its content key, a key of ``tenant``'s namespace.

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
        block.tenant = tenant
        self._cached[key] = block
        self._num_cached_by_tenant[tenant] = self._num_cached_by_tenant.get(tenant, 0) + 1
        if key in self._pin_counts:
            self.num_pinned_cached += 1
        if block.ref_count == 0 and block.queue_index != self._queue_of(block):
            self.free_queue.move(block, self._queue_of(block))
        return True

    def pin_keys(self, keys: Iterable[bytes]) -> None:
        """Count one more pin on each key. A cached, unreferenced block whose key becomes
        pinned moves to the pinned queue (keys in chain order: the tail ends nearer the head)."""
        for key in reversed(list(keys)):
            count = self._pin_counts.get(key, 0)
            self._pin_counts[key] = count + 1
            block = self._cached.get(key) if count == 0 else None
            if block is not None:
                self.num_pinned_cached += 1
                if block.ref_count == 0:
                    self.free_queue.move(block, self.pinned_queue)

    def unpin_keys(self, keys: Iterable[bytes]) -> None:
        """Drop one pin from each key. A cached, unreferenced block whose key is no longer
        pinned goes to the tail of its class's queue: evictable again, after the blocks
        released before it."""
        for key in reversed(list(keys)):
            count = self._pin_counts.get(key, 0)
            if count <= 0:
                raise ValueError(f"unpin of key {key.hex()[:8]}, which no pin covers")
            if count > 1:
                self._pin_counts[key] = count - 1
                continue
            del self._pin_counts[key]
            block = self._cached.get(key)
            if block is not None:
                self.num_pinned_cached -= 1
                if block.ref_count == 0:
                    self.free_queue.move(block, self._queue_of(block))

    def evict_cached(self, tenant: str | None = None) -> int:
        """Forget the cached keys of unreferenced blocks, pinned ones too: every one, or only those
        of ``tenant``'s namespace (a cache reset; the pins stay, and cover the blocks again once
        recomputed). Blocks running requests hold keep their keys. O(blocks in the free queue)."""
        dropped = 0
        for block in list(self.free_queue):
            if block.key is not None and (tenant is None or block.tenant == tenant):
                self._evict(block)
                dropped += 1
                if block.queue_index != 0:
                    self.free_queue.move(block, 0)
        return dropped

    def reset_peak(self) -> None:
        """Start a new high-water mark from the blocks in use now."""
        self.peak_num_used = 0
        self._note_usage()

    def _note_usage(self) -> None:
        self.peak_num_used = max(self.peak_num_used, self.num_blocks - self.free_queue.num_blocks)

    def _queue_of(self, block: Block) -> int:
        if block.key is None:
            return 0
        if block.key in self._pin_counts:
            return self.pinned_queue
        return block.retention

    def _check_class(self, retention: int) -> None:
        if not 0 <= retention < self.num_classes:
            raise ValueError(f"eviction class {retention} is outside 0..{self.num_classes - 1}")

    def _evict(self, block: Block) -> None:
        if block.key is None:
            return
        if block.key in self._pin_counts:
            self.num_pinned_cached -= 1
            self.num_pinned_evicted += 1
        del self._cached[block.key]
        self._num_cached_by_tenant[block.tenant] -= 1
        if not self._num_cached_by_tenant[block.tenant]:
            del self._num_cached_by_tenant[block.tenant]
        block.key = None
        block.token_ids = ()
        block.tenant = ""
        self.num_evicted_blocks += 1

    # -- checks ------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        queued = list(self.free_queue)
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued) == self.free_queue.num_blocks, "free queue corrupt"
        assert sum(q.num_blocks for q in self.free_queue.queues) == self.free_queue.num_blocks, "queue counts"
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count == 0 for b in queued), "a referenced block is in the free queue"
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(queued) == self.num_blocks, (
            f"used {len(used)} + queued {len(queued)} != total {self.num_blocks}")
        by_tag: dict[int, int] = {}
        for b in used:
            by_tag[b.tag] = by_tag.get(b.tag, 0) + 1
        assert by_tag == {t: n for t, n in self._num_used_by_tag.items() if n}, "used blocks per tag"
        for index, queue in enumerate(self.free_queue.queues):
            for block in queue:
                assert block.queue_index == index, f"{block} in queue {index} says {block.queue_index}"
                assert self._queue_of(block) == index, (
                    f"{block} (class {block.retention}, pinned {self.is_pinned(block)}) waits in queue {index}")
        for key, block in self._cached.items():
            assert block.key == key, f"{block} indexed under a key it does not hold"
            assert len(block.token_ids) == self.block_size, f"{block} cached while not full"
        assert sum(b.key is not None for b in self.blocks) == len(self._cached), "stray keys"
        by_tenant: dict[str, int] = {}
        for block in self._cached.values():
            by_tenant[block.tenant] = by_tenant.get(block.tenant, 0) + 1
        assert by_tenant == self._num_cached_by_tenant, f"cached blocks per tenant {self._num_cached_by_tenant}"
        assert all(b.tenant == "" for b in self.blocks if b.key is None), "a tenant on a block with no key"
        assert all(count > 0 for count in self._pin_counts.values()), "a pinned key with no pin"
        assert self.num_pinned_cached == sum(key in self._cached for key in self._pin_counts), (
            f"{self.num_pinned_cached} pinned blocks counted")
