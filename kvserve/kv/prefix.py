"""Content keys of KV blocks.

key(block i) = sha256(key(block i-1) | token ids of block i | extra key)

with 32 zero bytes as block 0's parent for a prompt's prefix, ``SEGMENT_ROOT`` for a segment's.

The extra key names everything besides the tokens that decides the block's
contents: the model fingerprint, the KV storage format, an optional salt. A key
therefore never depends on where a block lives, in this process or any other.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvserve.offload.base import KEY_NBYTES  # the key size every tier stores


def make_extra_key(model_fingerprint: str, kv_format: str, salt: str = "") -> bytes:
    """Fold the non-token inputs of a block's contents into one digest."""
    text = f"model={model_fingerprint}\x00format={kv_format}\x00salt={salt}"
    return hashlib.sha256(text.encode()).digest()


def block_key(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes) -> bytes:
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"\x00" * KEY_NBYTES)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra_key)
    return h.digest()


def extend_block_keys(keys: list[bytes], token_ids: Sequence[int], block_size: int,
                      extra_key: bytes, root: bytes | None = None) -> None:
    """Append the keys of every full block of ``token_ids`` not yet in ``keys``; the first
    block's parent is ``root`` (None: a prompt's prefix chain)."""
    num_full = len(token_ids) // block_size
    for i in range(len(keys), num_full):
        parent = keys[-1] if keys else root
        keys.append(block_key(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key))


# The parent of a segment's first block (kvserve/blend/): a segment's blocks hold KV computed
# standalone, from position 0 with no context before it. They chain like a prefix, block by
# block, but from this root instead of zeros, so a prefix match never meets a segment block and
# a segment lookup never meets a prompt's; either may change how it stores its blocks without
# touching the other's keys.
SEGMENT_ROOT = hashlib.sha256(b"kvserve segment chain v1").digest()


def segment_block_keys(token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[bytes]:
    """Keys of a segment's full blocks: its tokens' chain from ``SEGMENT_ROOT``. The extra key
    is the engine's (model, format and dtype, salt), as for prefix blocks."""
    keys: list[bytes] = []
    extend_block_keys(keys, token_ids, block_size, extra_key, root=SEGMENT_ROOT)
    return keys


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
