"""Content keys of KV blocks.

key(block i) = sha256(key(block i-1) | token ids of block i | extra key)

with 32 zero bytes as block 0's parent for a prompt's prefix, ``SEGMENT_ROOT`` for a segment's.

The extra key names everything besides the tokens that decides the block's
contents: the model fingerprint, the KV storage format, an optional salt. A key
therefore never depends on where a block lives, in this process or any other.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

from kvserve.offload.base import KEY_NBYTES  # the key size every tier stores


def make_extra_key(model_fingerprint: str, kv_format: str, salt: str = "", secret: bytes = b"") -> bytes:
    """Fold the non-token inputs of a block's contents into one digest, keyed with ``secret``
    (HMAC-SHA256) when there is one: then every block key depends on it, and a key seen in
    a listing cannot be matched to guessed tokens by anyone without the secret."""
    text = f"model={model_fingerprint}\x00format={kv_format}\x00salt={salt}".encode()
    return hmac.new(secret, text, hashlib.sha256).digest() if secret else hashlib.sha256(text).digest()


SECRET_NBYTES = 32


def load_or_create_secret(path: Path) -> bytes:
    """The secret in ``path``, created (random, mode 0600, atomically: concurrent engines
    agree on one) when the file does not exist. ValueError for a file of the wrong size."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_NBYTES))
        try:
            os.link(tmp, path)          # fails if another engine created it first: theirs wins
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        data = path.read_bytes()
    if len(data) != SECRET_NBYTES:
        raise ValueError(f"block key secret {path} holds {len(data)} bytes, not {SECRET_NBYTES}; "
                         "remove it to have a new one made (cached blocks keyed with the old one then miss)")
    return data


def salted_extra_key(extra_key: bytes, salt: str, tenant: str = "") -> bytes:
    """The extra key of a request in cache namespace (``tenant``, ``salt``): its blocks' keys
    share nothing with those of any other pair. ("", "") is the engine's own namespace
    (``extra_key`` itself); a salt alone is hashed as it always was. A tenant's namespace hashes
    the pair by lengths, in a domain of its own::

        ("", s)   sha256(E | 00 "salt" 00 | s)
        (t, s)    sha256(E | 00 "tenant" 00 | len(t) | t | len(s) | s)     len: 4 bytes, of UTF-8

    so no salt string spells another tenant's namespace, or the engine's own with another salt
    (the bytes after E differ, or the lengths do). E is keyed with the engine's secret."""
    if not tenant:
        return hashlib.sha256(extra_key + b"\x00salt\x00" + _utf8(salt)).digest() if salt else extra_key
    parts = [extra_key, b"\x00tenant\x00"]
    for data in (_utf8(tenant), _utf8(salt)):
        parts += [len(data).to_bytes(4, "little"), data]
    return hashlib.sha256(b"".join(parts)).digest()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")     # a JSON body may hold a lone surrogate: still one string


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


def segment_root(preamble: Sequence[int] = ()) -> bytes:
    """The parent of a segment's first block: ``SEGMENT_ROOT``, or where segments are computed
    after a preamble (kvserve/blend/segment.py), a root of that preamble's tokens, so segments
    stored after different preambles (or none) never meet."""
    if not preamble:
        return SEGMENT_ROOT
    return hashlib.sha256(SEGMENT_ROOT + b"preamble" + b"".join(t.to_bytes(4, "little") for t in preamble)).digest()


def segment_block_keys(token_ids: Sequence[int], block_size: int, extra_key: bytes,
                       preamble: Sequence[int] = ()) -> list[bytes]:
    """Keys of a segment's full blocks: its tokens' chain from ``segment_root(preamble)``. The
    extra key is the engine's (model, format and dtype, salt), as for prefix blocks."""
    keys: list[bytes] = []
    extend_block_keys(keys, token_ids, block_size, extra_key, root=segment_root(preamble))
    return keys


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where ``a`` and ``b`` hold the same token."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
