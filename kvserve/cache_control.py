"""Per-request cache control: how long a request's blocks stay cached, and which prefixes to pin.

``priority`` is the request's retention class: a cached block that a ``high`` request held
is evicted only after every ``normal`` one (each class in LRU order). A ``PrefixPin`` pins
the prompt's first ``num_tokens`` tokens (its full blocks; None: the whole prompt) for
``ttl_s`` seconds: pinned blocks are evicted only after every unpinned block, and demoted
to the offload tiers when they must go. The engine checks ``ttl_s`` against its own
limit (``max_pin_ttl_s``) and the pinned blocks against ``max_pinned_fraction``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CACHE_PRIORITIES = ("normal", "high")   # retention classes, evicted in this order
DEFAULT_PIN_TTL_S = 300.0               # a pin without a ttl: five minutes
MAX_PINS_PER_REQUEST = 4                # breakpoints in one request


@dataclass(frozen=True)
class PrefixPin:
    """Pin the prompt's first ``num_tokens`` tokens (None: all of it) for ``ttl_s`` seconds."""

    num_tokens: int | None = None
    ttl_s: float = DEFAULT_PIN_TTL_S

    def __post_init__(self) -> None:
        if self.num_tokens is not None and (not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool)
                                            or self.num_tokens < 1):
            raise ValueError(f"a pin's num_tokens must be a positive integer, got {self.num_tokens!r}")
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) or not (
                self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"a pin's ttl must be a positive number of seconds, got {self.ttl_s!r}")


MAX_SALT_CHARS = 256
MAX_TENANT_CHARS = 64


@dataclass(frozen=True)
class CacheControl:
    """A request's retention class, the prefixes it pins (at most ``MAX_PINS_PER_REQUEST``) and
    its cache namespace, the pair (``tenant``, ``salt``): requests share cached blocks (prefix
    hits, tier entries, pins, stored segments) only with requests of the same pair. ("", "") is
    the engine's own namespace; ``salt`` is vLLM's ``cache_salt``; ``tenant`` is a server's
    tenant (docs/server.md "Tenants"), whose blocks and pins a reset or a listing scoped to it
    finds. The pair is hashed by lengths (kv/prefix.salted_extra_key): no salt string names
    another tenant's namespace."""

    priority: str = "normal"
    pins: tuple[PrefixPin, ...] = ()
    salt: str = ""
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.priority not in CACHE_PRIORITIES:
            raise ValueError(f"cache priority must be one of {', '.join(CACHE_PRIORITIES)}, got {self.priority!r}")
        object.__setattr__(self, "pins", tuple(self.pins))
        if len(self.pins) > MAX_PINS_PER_REQUEST:
            raise ValueError(f"at most {MAX_PINS_PER_REQUEST} pinned prefixes per request, got {len(self.pins)}")
        if any(not isinstance(p, PrefixPin) for p in self.pins):
            raise ValueError("pins must be PrefixPin objects")
        if not isinstance(self.salt, str) or len(self.salt) > MAX_SALT_CHARS:
            raise ValueError(f"cache_salt must be a string of at most {MAX_SALT_CHARS} characters")
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS:
            raise ValueError(f"a tenant's name must be a string of at most {MAX_TENANT_CHARS} characters")

    @property
    def retention_class(self) -> int:
        """The pool's class index of ``priority`` (higher: evicted later)."""
        return CACHE_PRIORITIES.index(self.priority)


NO_CACHE_CONTROL = CacheControl()
