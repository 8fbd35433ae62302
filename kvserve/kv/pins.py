"""Pinned prefixes: content keys kept on the device past every unpinned block, for a while.

A pin covers the keys of a prefix's full blocks and is named by its last key (which names
the whole chain), so pinning the same prefix again is the same pin: its expiry becomes the
later of the two. The pool counts pins per key and queues a pinned block after every other
(kv/block_pool.py); this table holds the pins, their expiry and the limit:

    pins        {last key: Pin(keys, expires_at)}      pin / unpin: O(blocks of the prefix)
    expiry      heap of (expires_at, last key)          expire(): O(log pins) per pin due
                (an entry whose pin was extended or removed is skipped when popped)

The limit counts distinct pinned keys, whether their blocks are on the device, in a tier
or not computed yet: at most ``max_pinned_blocks``, so pins can never claim the pool.
Time comes from ``clock`` (injected: tests step it). Contract: one thread (the engine's).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvserve.kv.block_pool import BlockPool

Clock = Callable[[], float]


class PinLimitError(ValueError):
    """A pin that would take more of the pool than the engine allows (or pinning is off)."""


class PinNotFoundError(LookupError):
    """No pin covers exactly the prefix given."""


class PinInfo(NamedTuple):
    """A pinned prefix as of the call."""

    block_keys: tuple[bytes, ...]   # in chain order; the last names the pin
    num_tokens: int                 # tokens the pinned blocks hold
    expires_in_s: float             # seconds left (0 for a pin just removed)
    num_device_blocks: int          # of its blocks, those on the device now
    salt: str = ""                  # the cache namespace its keys were made in: salt and tenant
    tenant: str = ""


@dataclass(frozen=True)
class PinStats:
    num_pins: int
    num_pinned_keys: int            # distinct keys the pins cover
    num_pinned_blocks: int          # device blocks holding a pinned key
    max_pinned_blocks: int          # the limit on pinned keys
    num_expired: int                # pins that ran out, cumulative
    num_evicted_blocks: int         # pinned blocks evicted for room, cumulative (demoted when a tier exists)
    pins_by_tenant: tuple[tuple[str, int], ...] = ()    # (tenant, pins) of each tenant holding any ("" too)


NO_PIN_STATS = PinStats(0, 0, 0, 0, 0, 0)


@dataclass
class _Pin:
    keys: tuple[bytes, ...]
    expires_at: float
    salt: str = ""
    num_tokens: int = 0
    tenant: str = ""


class Pins:
    def __init__(self, pool: BlockPool, max_pinned_blocks: int, max_ttl_s: float,
                 clock: Clock = time.monotonic) -> None:
        if max_pinned_blocks < 0 or max_ttl_s <= 0:
            raise ValueError(f"bad pin limits: {max_pinned_blocks} blocks, {max_ttl_s} s")
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self._pins: dict[bytes, _Pin] = {}
        self._expiry: list[tuple[float, bytes]] = []
        self._num_by_tenant: dict[str, int] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._pins)

    # -- verbs -------------------------------------------------------------
    def pin(self, prefixes: Sequence[tuple[Sequence[bytes], float]], salt: str = "",
            num_tokens: Sequence[int] | None = None, tenant: str = "") -> list[PinInfo]:
        """Pin each ``(keys, ttl_s)`` (keys made in cache namespace (``tenant``, ``salt``)), all or
        none: PinLimitError (nothing pinned) when the new keys would pass the limit, ValueError
        for a ttl over ``max_ttl_s`` or an empty prefix.
        ``num_tokens``: the tokens each prefix holds (default: a block's per key; a model of
        several layer groups pins more keys than its prefix has blocks)."""
        self.expire()
        for keys, ttl_s in prefixes:
            if not keys:
                raise ValueError("a pinned prefix needs at least one full block")
            if not 0 < ttl_s <= self.max_ttl_s:
                raise ValueError(f"a pin's ttl must be in (0, {self.max_ttl_s:g}] seconds (this engine's "
                                 f"max_pin_ttl_s), got {ttl_s:g}")
        new_keys = {k for keys, _ in prefixes for k in keys if not self.pool.pin_count(k)}
        total = self.pool.num_pinned_keys + len(new_keys)
        if new_keys and total > self.max_pinned_blocks:
            if self.max_pinned_blocks == 0:
                raise PinLimitError("pinning is off on this engine (max_pinned_fraction is 0)")
            raise PinLimitError(
                f"pinning {len(new_keys)} more blocks would make {total} pinned, over this engine's limit of "
                f"{self.max_pinned_blocks} of {self.pool.num_blocks} blocks (max_pinned_fraction); unpin a "
                "prefix or wait for pins to expire")
        now = self.clock()
        out = []
        for i, (keys, ttl_s) in enumerate(prefixes):
            name, expires_at = keys[-1], now + ttl_s
            pin = self._pins.get(name)
            if pin is None:
                tokens = len(keys) * self.pool.block_size if num_tokens is None else num_tokens[i]
                pin = self._pins[name] = _Pin(tuple(keys), expires_at, salt, tokens, tenant)
                self._num_by_tenant[tenant] = self._num_by_tenant.get(tenant, 0) + 1
                self.pool.pin_keys(pin.keys)
                heapq.heappush(self._expiry, (expires_at, name))
            elif expires_at > pin.expires_at:
                pin.expires_at = expires_at
                heapq.heappush(self._expiry, (expires_at, name))
            out.append(self._info(pin, now))
        return out

    def unpin(self, keys: Sequence[bytes]) -> PinInfo:
        """Remove the pin over exactly ``keys``; PinNotFoundError when there is none."""
        self.expire()
        pin = self._pins.get(keys[-1]) if keys else None
        if pin is None or pin.keys != tuple(keys):
            raise PinNotFoundError(f"no pin covers exactly this prefix ({len(keys)} full blocks)")
        self._remove(keys[-1])
        return self._info(pin, pin.expires_at)

    def unpin_all(self, tenant: str | None = None) -> list[PinInfo]:
        """Remove every pin of ``tenant`` (None: every pin); returns them."""
        return [self.unpin(p.keys) for p in list(self._pins.values()) if tenant is None or p.tenant == tenant]

    def expire(self) -> int:
        """Remove the pins whose time is up; returns how many."""
        now = self.clock()
        num = 0
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, name = heapq.heappop(self._expiry)
            pin = self._pins.get(name)
            if pin is not None and pin.expires_at == expires_at:
                self._remove(name)
                num += 1
        self.num_expired += num
        return num

    def _remove(self, name: bytes) -> None:
        pin = self._pins.pop(name)
        self._num_by_tenant[pin.tenant] -= 1
        if not self._num_by_tenant[pin.tenant]:
            del self._num_by_tenant[pin.tenant]
        self.pool.unpin_keys(pin.keys)

    # -- queries -----------------------------------------------------------
    def infos(self, tenant: str | None = None) -> list[PinInfo]:
        """Every pin of ``tenant`` (None: every pin), soonest to expire first."""
        now = self.clock()
        return [self._info(p, now) for p in sorted(self._pins.values(), key=lambda p: p.expires_at)
                if tenant is None or p.tenant == tenant]

    def _info(self, pin: _Pin, now: float) -> PinInfo:
        on_device = sum(self.pool.holds(k) for k in pin.keys)
        return PinInfo(pin.keys, pin.num_tokens, max(0.0, pin.expires_at - now), on_device, pin.salt, pin.tenant)

    def is_pinned(self, key: bytes) -> bool:
        return self.pool.pin_count(key) > 0

    def stats(self) -> PinStats:
        return PinStats(num_pins=len(self._pins), num_pinned_keys=self.pool.num_pinned_keys,
                        num_pinned_blocks=self.pool.num_pinned_cached, max_pinned_blocks=self.max_pinned_blocks,
                        num_expired=self.num_expired, num_evicted_blocks=self.pool.num_pinned_evicted,
                        pins_by_tenant=tuple(sorted(self._num_by_tenant.items())))

    def check_integrity(self) -> None:
        """The pool's count on each key is the number of pins covering it; every pin is in the heap."""
        counts: dict[bytes, int] = {}
        for name, pin in self._pins.items():
            assert pin.keys and pin.keys[-1] == name, f"pin {name.hex()[:8]} named by a key it does not end with"
            for key in pin.keys:
                counts[key] = counts.get(key, 0) + 1
        assert self.pool.num_pinned_keys == len(counts), (
            f"the pool counts {self.pool.num_pinned_keys} pinned keys, the pins cover {len(counts)}")
        for key, count in counts.items():
            assert self.pool.pin_count(key) == count, f"key {key.hex()[:8]}: {self.pool.pin_count(key)} != {count}"
        by_tenant: dict[str, int] = {}
        for pin in self._pins.values():
            by_tenant[pin.tenant] = by_tenant.get(pin.tenant, 0) + 1
        assert by_tenant == self._num_by_tenant, f"pins per tenant {self._num_by_tenant}, counted {by_tenant}"
        live = {(p.expires_at, name) for name, p in self._pins.items()}
        assert live <= set(self._expiry), "a pin missing from the expiry heap"
        assert len(counts) <= self.max_pinned_blocks, "more keys pinned than the limit"
