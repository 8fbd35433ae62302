"""Measure each tier's bandwidth and latency on this machine, for the load-or-recompute
cost model and for docs/offload.md. Not a test: a table printed to stdout.

    python -m kvserve.offload.measure [--blocks 1000] [--batch 32] [--redis-url URL]

Without ``--redis-url`` it starts a throwaway redis-server on a free loopback port
(when one is installed) and waits until it answers a PING. Disk reads are timed twice: warm (just written, in the page
cache) and cold (pages dropped with posix_fadvise first).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from kvserve.offload.registry import make_store
from kvserve.offload.store import BlockStore

# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims = 11,520 values per token;
# int8 stores them in 11,880 bytes per token (with its scales), fp32 in 46,080
BLOCK_SIZES = {"int8 (SmolLM2)": 16 * 11_880, "fp32 (SmolLM2)": 737_280}


class Measurement(NamedTuple):
    write_s: float  # all blocks, in batches
    read_s: float  # all blocks, in batches, all hits
    get_one_s: float  # median latency of a one-block get (a hit)


def measure(store: BlockStore, nbytes: int, num_blocks: int, batch: int,
            before_read: Callable[[], None] = lambda: None) -> Measurement:
    payload = os.urandom(nbytes)
    keys = [hashlib.sha256(f"{nbytes}/{i}".encode()).digest() for i in range(num_blocks)]
    batches = [keys[i:i + batch] for i in range(0, num_blocks, batch)]
    start = time.perf_counter()
    for b in batches:
        if store.put([(k, payload) for k in b]) != len(b):
            raise RuntimeError(f"{store.tier} tier dropped blocks: is it large enough for {num_blocks} blocks?")
    write_s = time.perf_counter() - start
    before_read()
    start = time.perf_counter()
    for b in batches:
        if any(p is None for p in store.get(b)):
            raise RuntimeError(f"{store.tier} tier lost blocks it was just given")
    read_s = time.perf_counter() - start
    before_read()
    one = []
    for k in keys[:: max(1, num_blocks // 50)]:
        t = time.perf_counter()
        store.get([k])
        one.append(time.perf_counter() - t)
    store.remove(keys)
    return Measurement(write_s, read_s, statistics.median(one))


def drop_page_cache(root: Path) -> None:
    for path in root.glob("*/*.blk"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def wait_until_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 10.0) -> None:
    """Ping the server on ``port`` until it answers; raise if it exits or ``timeout_s`` passes."""
    import redis  # only here: measuring the host and disk tiers does not need the client

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.2, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.01)
    finally:
        client.close()


@contextmanager
def throwaway_redis() -> Iterator[str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until_ready(proc, port)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


def _row(tier: str, fmt: str, nbytes: int, n: int, m: Measurement, read_label: str = "") -> str:
    total_mb = nbytes * n / 1e6
    return (f"| {tier}{read_label} | {fmt} | {nbytes:,} | {total_mb / m.write_s:,.0f} | {total_mb / m.read_s:,.0f} "
            f"| {m.get_one_s * 1e3:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32, help="blocks per put / get call")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    args = parser.parse_args(argv)
    print(f"{args.blocks} blocks per run, {args.batch} blocks per call; MB = 1e6 bytes, payload only\n")
    print("| tier | format | block bytes | write MB/s | read MB/s | 1-block get ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    with throwaway_redis() as local_url:
        redis_url = args.redis_url or local_url
        for fmt, nbytes in BLOCK_SIZES.items():
            capacity = 2 * args.blocks * (nbytes + 64)
            host = make_store("host", fmt, capacity_bytes=capacity)
            print(_row("host", fmt, nbytes, args.blocks, measure(host, nbytes, args.blocks, args.batch)), flush=True)
            host.close()
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                disk = make_store("disk", fmt, path=root, capacity_bytes=capacity)
                print(_row("disk", fmt, nbytes, args.blocks, measure(disk, nbytes, args.blocks, args.batch),
                           " (page cache)"), flush=True)
                cold = measure(disk, nbytes, args.blocks, args.batch, lambda: drop_page_cache(Path(root)))
                print(_row("disk", fmt, nbytes, args.blocks, cold, " (cold)"), flush=True)
                disk.close()
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                nosync = make_store("disk", fmt, path=root, capacity_bytes=capacity, fsync=False)
                print(_row("disk fsync=False", fmt, nbytes, args.blocks,
                           measure(nosync, nbytes, args.blocks, args.batch), " (page cache)"), flush=True)
                nosync.close()
            if redis_url is not None:
                redis = make_store("redis", fmt, url=redis_url, namespace="kvserve-measure")
                print(_row("redis (loopback)", fmt, nbytes, args.blocks,
                           measure(redis, nbytes, args.blocks, args.batch)), flush=True)
                redis.close()
    if redis_url is None:
        print("\n(redis: no redis-server installed and no --redis-url given)")


if __name__ == "__main__":
    main()
