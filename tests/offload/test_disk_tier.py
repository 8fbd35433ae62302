import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.offload import BlockStore, DiskConfig, make_store
from kvserve.offload.disk import DiskTransport
from kvserve.offload.serialization import HEADER_NBYTES

FMT = "model=test/format=int8"
REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, nbytes: int = 1000) -> bytes:
    return (key(i) * (nbytes // 32 + 1))[:nbytes]


def open_store(path: Path, capacity_bytes: int = 1 << 30) -> BlockStore:
    return BlockStore(DiskTransport(DiskConfig(path=str(path), capacity_bytes=capacity_bytes)), FMT)


def test_round_trip_and_file_layout(tmp_path):
    store = make_store("disk", FMT, path=str(tmp_path), capacity_bytes=1 << 20)
    assert store.put([(key(i), payload(i)) for i in range(3)]) == 3
    assert store.get([key(0), key(9), key(2)]) == [payload(0), None, payload(2)]
    assert store.contains([key(1), key(9)]) == [True, False]
    hexkey = key(1).hex()
    assert (tmp_path / hexkey[:2] / f"{hexkey}.blk").stat().st_size == HEADER_NBYTES + 1000
    store.remove([key(1)])
    assert not (tmp_path / hexkey[:2] / f"{hexkey}.blk").exists()
    assert store.transport.nbytes_used == 2 * (HEADER_NBYTES + 1000)
    s = store.stats()
    assert (s.hits, s.misses, s.bytes_read, s.bytes_written, s.blocks_written) == (2, 1, 2000, 3000, 3)
    store.check_integrity()
    store.close()


def test_a_new_store_on_the_same_directory_sees_the_blocks(tmp_path):
    store = open_store(tmp_path)
    store.put([(key(i), payload(i)) for i in range(5)])
    with pytest.raises(RuntimeError, match="in use by another store"):
        open_store(tmp_path)
    store.close()
    leftover = tmp_path / key(0).hex()[:2] / f"{key(0).hex()}.x1y2.tmp"
    leftover.write_bytes(b"half a block")
    again = open_store(tmp_path)
    assert again.transport.num_temp_files_removed == 1 and not leftover.exists()
    assert again.get([key(i) for i in range(5)]) == [payload(i) for i in range(5)]
    assert again.transport.nbytes_used == 5 * (HEADER_NBYTES + 1000)
    again.check_integrity()
    again.close()


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "empty", "swap_files"])
def test_a_damaged_file_is_detected_removed_and_a_miss(tmp_path, damage):
    store = open_store(tmp_path)
    store.put([(key(0), payload(0)), (key(1), payload(1))])
    path = tmp_path / key(0).hex()[:2] / f"{key(0).hex()}.blk"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:700]
    elif damage == "flip_payload":
        data[500] ^= 0xFF
    elif damage == "flip_header":
        data[58] ^= 0x10
    elif damage == "empty":
        data = bytearray()
    else:  # a valid block of another key, filed under this one
        data = bytearray((tmp_path / key(1).hex()[:2] / f"{key(1).hex()}.blk").read_bytes())
    path.write_bytes(bytes(data))
    assert store.get([key(0), key(1)]) == [None, payload(1)]
    assert not path.exists() and store.contains([key(0)]) == [False]
    s = store.stats()
    assert (s.corrupt, s.hits, s.misses) == (1, 1, 1)
    store.check_integrity()
    store.close()


def test_a_file_deleted_behind_its_back_is_a_miss(tmp_path):
    store = open_store(tmp_path)
    store.put([(key(0), payload(0))])
    (tmp_path / key(0).hex()[:2] / f"{key(0).hex()}.blk").unlink()
    assert store.get([key(0)]) == [None]
    assert store.transport.nbytes_used == 0
    store.check_integrity()
    store.close()


WRITER = """
import sys
from kvserve.offload import make_store
sys.path.insert(0, sys.argv[2])
from test_disk_tier import key, payload
store = make_store("disk", sys.argv[3], path=sys.argv[1], capacity_bytes=1 << 40)
for i in range(500):
    store.put([(key(i), payload(i, 4 << 20))])
"""


def test_a_write_killed_midway_leaves_no_torn_block(tmp_path):
    """SIGKILL a writer while one of its temp files exists: the store reopens cleanly."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(Path(__file__).parent), FMT],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 20
    try:
        while True:  # kill when >= 2 blocks are complete and the next is half written
            if len(list(tmp_path.glob("*/*.blk"))) >= 2 and list(tmp_path.glob("*/*.tmp")):
                break
            assert proc.poll() is None, "the writer exited before it could be killed"
            assert time.monotonic() < deadline, "the writer made no progress"
            time.sleep(0.001)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    temps = list(tmp_path.glob("*/*.tmp"))
    assert len(temps) <= 1  # one writer thread: almost always exactly the write it was killed in
    written = sorted(tmp_path.glob("*/*.blk"))
    store = open_store(tmp_path)
    assert store.transport.num_temp_files_removed == len(temps)
    assert list(tmp_path.glob("*/*.tmp")) == []
    index = {bytes.fromhex(p.stem) for p in written}
    expected = {key(i): i for i in range(500) if key(i) in index}
    assert len(expected) == len(written) >= 2
    got = store.get(list(expected))
    assert all(p == payload(expected[k], 4 << 20) for k, p in zip(expected, got))
    assert store.stats().corrupt == 0
    store.check_integrity()
    store.close()


def test_capacity_evicts_least_recently_accessed_and_the_order_survives_a_restart(tmp_path):
    entry = HEADER_NBYTES + 1000
    store = open_store(tmp_path, capacity_bytes=3 * entry)
    store.put([(key(i), payload(i)) for i in range(3)])
    store.get([key(0)])  # 0 becomes most recent: order 1, 2, 0
    store.put([(key(3), payload(3))])  # evicts 1
    assert store.contains([key(i) for i in range(4)]) == [True, False, True, True]
    assert store.transport.keys_lru_first() == [key(2), key(0), key(3)]
    store.get([key(2)])  # order 0, 3, 2
    store.close()
    again = open_store(tmp_path, capacity_bytes=3 * entry)  # order seeded from mtimes
    assert again.transport.keys_lru_first() == [key(0), key(3), key(2)]
    again.put([(key(4), payload(4))])
    assert again.contains([key(i) for i in range(5)]) == [False, False, True, True, True]
    assert again.put([(key(5), payload(5, 4 * entry))]) == 0  # larger than the tier: refused
    assert again.stats().puts_dropped == 1
    again.check_integrity()
    again.close()
    smaller = open_store(tmp_path, capacity_bytes=entry)  # a lower capacity evicts at start
    assert smaller.transport.keys_lru_first() == [key(4)]
    smaller.check_integrity()
    smaller.close()


def test_a_write_that_fails_is_dropped_and_counted_not_raised(tmp_path):
    store = open_store(tmp_path)
    (tmp_path / key(0).hex()[:2]).write_bytes(b"")  # a file where the block's folder should be
    assert store.put([(key(0), payload(0)), (key(1), payload(1))]) == 1
    assert store.transport.num_write_errors == 1 and store.stats().puts_dropped == 1
    assert store.get([key(0), key(1)]) == [None, payload(1)]
    store.check_integrity()
    store.close()


def test_only_its_owner_can_list_the_directories_and_stray_temps_are_swept(tmp_path):
    root = tmp_path / "tier"
    root.mkdir(mode=0o755)
    (root / "stray.0123.tmp").write_bytes(b"half a block")        # a temp left at the root
    store = open_store(root)
    store.put([(key(1), payload(1))])
    folder = root / key(1).hex()[:2]
    assert store.transport.num_temp_files_removed == 1 and not (root / "stray.0123.tmp").exists()
    assert root.stat().st_mode & 0o777 == 0o700 and folder.stat().st_mode & 0o777 == 0o700
    store.close()
    os.chmod(folder, 0o755)                                        # made by an older version
    open_store(root).close()
    assert folder.stat().st_mode & 0o777 == 0o700
