"""Local-disk tier: one content-addressed file per block, persistent and crash-safe.

    <dir>/.lock                       held (flock) by the one process using the directory
    <dir>/ab/ab12...ef.blk            a block whose key hex starts with "ab"
    <dir>/ab/ab12...ef.<rand>.tmp     a write in progress (removed at the next start)

A write goes to a temp file in the block's own folder, is fsynced, then renamed over the
final name (``os.replace`` is atomic): a process killed mid-write leaves only a temp
file, never a torn block under a final name. Damage the rename cannot prevent (a file
altered or truncated later, a power loss without fsync) is caught by the checksum that
``BlockStore`` verifies on every read.

The index (key -> file size, in LRU order) lives in memory. It is rebuilt at start by
scanning the directory and ordering files by mtime; a hit sets the file's mtime to now,
so the LRU order survives a restart.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvserve.config import DiskConfig
from kvserve.offload.base import KEY_NBYTES
from kvserve.offload.lru import LRUTransport

logger = logging.getLogger(__name__)

_BLOCK_SUFFIX = ".blk"
_TEMP_SUFFIX = ".tmp"


class DiskTransport(LRUTransport):
    """One file per key, next to the index of ``LRUTransport`` and under its lock.

    Invariant: ``nbytes_used == sum(index sizes) <= capacity_bytes``, counting final
    files only (a write's temp file exists briefly on top, for one value per writer)."""

    name = "disk"
    is_local = True          # the index is in memory
    is_write_once = True     # a rewrite of a key costs an fsync for the same content
    # measured in docs/offload.md (int8 SmolLM2 blocks, cold reads)
    prior_read_latency_s = 0.4e-3
    prior_read_bytes_per_s = 200e6

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config.capacity_bytes)   # the index: key -> file size
        self._root = Path(config.path)
        self._fsync = config.fsync
        self._closed = False
        self.num_write_errors = 0
        # block files are named by their keys: only this user may list them
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self._root, 0o700)
        self._lock_file = open(self._root / ".lock", "a+b")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeError(f"disk tier {self._root} is in use by another store (its .lock is held); "
                               f"give each engine its own directory or close the other store first") from None
        self.num_temp_files_removed = self._scan()
        with self._lock:
            self._evict(0)   # a capacity lower than at the last run

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self._root / name[:2] / (name + _BLOCK_SUFFIX)

    def _scan(self) -> int:
        """Index the blocks already on disk, oldest access first; delete leftover temp files."""
        found: list[tuple[int, str, bytes, int]] = []
        num_temp = 0
        for folder in self._root.iterdir():
            if folder.name.endswith(_TEMP_SUFFIX) and folder.is_file():   # a stray temp at the root
                folder.unlink()
                num_temp += 1
                continue
            if not (folder.is_dir() and len(folder.name) == 2):
                continue
            os.chmod(folder, 0o700)
            for entry in os.scandir(folder):
                if entry.name.endswith(_TEMP_SUFFIX):
                    os.unlink(entry.path)
                    num_temp += 1
                    continue
                stem = entry.name[:-len(_BLOCK_SUFFIX)]
                if not entry.name.endswith(_BLOCK_SUFFIX) or len(stem) != 2 * KEY_NBYTES:
                    continue
                try:
                    key = bytes.fromhex(stem)
                except ValueError:
                    continue
                st = entry.stat()
                found.append((st.st_mtime_ns, stem, key, st.st_size))
        found.sort()
        for _, _, key, size in found:
            self._index.add(key, size)
        if num_temp:
            logger.info("disk tier %s: removed %d temp files left by an interrupted write", self._root, num_temp)
        return num_temp

    def _drop_value(self, key: bytes) -> None:
        self._path(key).unlink(missing_ok=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk tier {self._root} is closed")

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._check_open()
        with self._lock:
            present = [self._index.touch(key) for key in keys]
        out: list[bytes | None] = []
        now_ns = time.time_ns()
        for key, hit in zip(keys, present):
            out.append(self._read(key, now_ns) if hit else None)
        return out

    def _read(self, key: bytes, now_ns: int) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
                os.utime(f.fileno(), ns=(now_ns, now_ns))
            return data
        except FileNotFoundError:
            # evicted by a concurrent put, or deleted behind our back
            with self._lock:
                if key in self._index and not path.exists():
                    self._index.pop(key)
            return None
        except OSError as e:
            logger.warning("disk tier %s: cannot read %s: %s; treating it as a miss", self._root, path.name, e)
            return None

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self._check_open()
        stored = 0
        for key, value in items:
            if len(key) != KEY_NBYTES:
                raise ValueError(f"a block key is {KEY_NBYTES} bytes, got {len(key)}")
            if not self._index.fits(len(value)):
                continue
            stored += self._put(key, value)
        return stored

    def _put(self, key: bytes, value: bytes) -> int:
        final = self._path(key)
        tmp: str | None = None
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=final.stem + ".", suffix=_TEMP_SUFFIX)
            with open(fd, "wb") as f:
                f.write(value)
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            now_ns = time.time_ns()  # explicit: the kernel's file clock is too coarse to order puts
            os.utime(tmp, ns=(now_ns, now_ns))
            with self._lock:
                self._check_open()
                self._index.pop(key)
                self._evict(len(value))
                os.replace(tmp, final)
                tmp = None
                self._index.add(key, len(value))
            return 1
        except OSError as e:  # ENOSPC, EIO, permissions: drop the block; only the first is logged loudly
            with self._lock:
                self.num_write_errors += 1
                first = self.num_write_errors == 1
            (logger.warning if first else logger.debug)(
                "disk tier %s: cannot write block %s: %s; dropped (later failures are logged at debug level)",
                self._root, key.hex()[:16], e)
            return 0
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock_file.close()  # releases the flock

    def _check_values(self) -> None:
        """Every indexed file present with its size (one stat per block)."""
        for key, size in self._index.items():
            path = self._path(key)
            assert path.is_file(), f"disk tier indexes {path.name}, which is missing"
            assert path.stat().st_size == size, f"disk tier indexes {path.name} at {size} bytes"
