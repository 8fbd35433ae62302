"""Content keys of KV blocks.

key(block i) = sha256(key(block i-1) | token ids of block i | extra key)

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
                      extra_key: bytes) -> None:
    """Append the keys of every full block of ``token_ids`` not yet in ``keys``."""
    num_full = len(token_ids) // block_size
    for i in range(len(keys), num_full):
        parent = keys[-1] if keys else None
        keys.append(block_key(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key))
