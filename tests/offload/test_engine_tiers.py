"""The offload tiers inside the engine: demote on eviction, promote on a prefix hit.

A tiny random model with an 8-block device pool (see tiers_util.py).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiers_util import (
    FILL,
    GREEDY,
    MIB,
    POOL,
    PROMPT,
    PROMPT_HIT,
    cold_batch,
    cold_tokens,
    evict_everything,
    filler,
    offload,
)
from tiny import tiny_model

from kvserve import LLM
from kvserve.kv.block_io import block_nbytes
from kvserve.kv.prefix import extend_block_keys
from kvserve.kv.tiering import OffloadTiering

TESTS_DIR = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def tier_options(tier: str, tmp_path: Path, redis_url: str | None = None) -> dict:
    if tier == "host":
        return {"host_cache_gb": MIB}
    if tier == "disk":
        return {"disk_cache_dir": str(tmp_path / "blocks")}
    return {"redis_url": redis_url, "redis_backoff_s": 0.2}


def run_child(code: str) -> str:
    """Run ``code`` in a new Python process (tests/ on its path); returns its stdout."""
    prelude = f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


CHILD_WARMS_THE_TIERS = """
import json
from tiny import tiny_model
from kvserve import LLM, SamplingParams
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
with LLM(loaded=tiny_model(), num_kv_blocks={pool}, **{options!r}) as llm:
    out = llm.generate({prompt!r}, greedy)[0]
    llm.generate({filler!r}, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    print(json.dumps(out.token_ids))
"""


@pytest.mark.parametrize("kv_format", ["native", "int8"])
@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_a_hit_from_each_tier_gives_the_cold_tokens(loaded, tier, kv_format, tmp_path, request):
    url = request.getfixturevalue("redis_server").url if tier == "redis" else None
    with LLM(loaded=loaded, num_kv_blocks=POOL, kv_format=kv_format, **tier_options(tier, tmp_path, url)) as llm:
        first = llm.generate(PROMPT, GREEDY)[0]
        assert first.num_cached_tokens == 0
        evict_everything(llm)
        again = llm.generate(PROMPT, GREEDY)[0]
        assert again.token_ids == first.token_ids == cold_tokens(loaded, kv_format)
        assert again.num_cached_tokens == PROMPT_HIT
        stats = llm.engine.stats()
        (t,) = stats.tiers
        assert t.tier == tier
        assert (t.hit_tokens, t.loaded_tokens) == (PROMPT_HIT, PROMPT_HIT)
        assert t.bytes_loaded == 4 * block_nbytes(llm.engine.runner.cache.block_tensors())
        assert t.store.blocks_written >= 4 and t.store.corrupt == 0
        assert stats.prefix_hit_tokens == 0 and stats.recompute_tokens_avoided == PROMPT_HIT
        llm.engine.check_integrity()


def test_no_tier_configured_keeps_the_null_offload(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=POOL)
    assert not isinstance(llm.engine.kv._tiering, OffloadTiering)
    llm.generate(PROMPT, GREEDY)
    evict_everything_without_tiers = llm.generate(filler(0), FILL)
    assert evict_everything_without_tiers[0].finished
    assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0
    assert llm.engine.stats().tiers == ()


def test_a_new_engine_process_on_the_same_disk_directory_gets_hits(loaded, tmp_path):
    options = {"disk_cache_dir": str(tmp_path / "blocks")}
    child = run_child(CHILD_WARMS_THE_TIERS.format(pool=POOL, options=options, prompt=PROMPT, filler=filler(0)))
    assert json.loads(child) == cold_tokens(loaded)
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.num_cached_tokens == PROMPT_HIT
        assert out.token_ids == cold_tokens(loaded)


def block_file(llm: LLM, root: Path, index: int) -> Path:
    keys: list[bytes] = []
    extend_block_keys(keys, PROMPT, 16, llm.engine.kv.extra_key)
    name = keys[index].hex()
    return root / name[:2] / f"{name}.blk"


def test_a_damaged_block_file_is_recomputed_never_served(loaded, tmp_path):
    root = tmp_path / "blocks"
    options = {"disk_cache_dir": str(root)}
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        llm.generate(PROMPT, GREEDY)
        evict_everything(llm)
        third, first = block_file(llm, root, 2), block_file(llm, root, 0)
    third.write_bytes(third.read_bytes()[:-100])                     # truncated
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.token_ids == cold_tokens(loaded)
        assert out.num_cached_tokens == 32                           # blocks 0 and 1 only
        assert llm.engine.stats().tiers[0].store.corrupt == 1
        llm.engine.check_integrity()
    data = bytearray(first.read_bytes())
    data[500] ^= 0x01                                                # one flipped payload bit
    first.write_bytes(bytes(data))
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.token_ids == cold_tokens(loaded)
        assert out.num_cached_tokens == 0
        assert llm.engine.stats().tiers[0].store.corrupt == 1
    assert not first.exists()                                        # the store removed it


def test_redis_stopped_during_a_run_then_back(loaded, redis_server):
    prompts = [PROMPT[:40] + [i] * (10 + i) for i in range(6)]
    with LLM(loaded=loaded, num_kv_blocks=POOL, redis_url=redis_server.url, redis_backoff_s=0.2) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        finished: dict[str, list[int]] = {}
        for step in range(1000):
            if step == 3:
                redis_server.stop()
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
            if not engine.has_unfinished:
                break
        assert sorted(finished) == sorted(ids)
        assert [finished[i] for i in ids] == cold_batch(loaded, prompts)
        evict_everything(llm)            # its demotions are dropped: the server is down
        assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0
        assert engine.stats().tier_hit_tokens == 0
        assert engine.stats().tiers[0].store.unavailable_periods >= 1

        redis_server.start()             # same port, empty
        transport = offload(llm).store.tiers[0].store.transport
        deadline = time.monotonic() + 60     # each failed probe doubled the backoff
        while not transport.is_available:    # a call after the backoff probes the server
            assert time.monotonic() < deadline
            transport.exists([bytes(32)])
            time.sleep(0.05)
        evict_everything(llm, seed=1)    # demotes PROMPT's blocks (computed above) to Redis
        evict_everything(llm, seed=2)
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.num_cached_tokens == PROMPT_HIT
        assert out.token_ids == cold_tokens(loaded)
        engine.check_integrity()


def test_a_second_engine_process_is_served_the_first_ones_prefix_from_redis(loaded, redis_server):
    options = {"redis_url": redis_server.url}
    run_child(CHILD_WARMS_THE_TIERS.format(pool=POOL, options=options, prompt=PROMPT, filler=filler(0)))
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.num_cached_tokens == PROMPT_HIT
        assert out.token_ids == cold_tokens(loaded)
        assert llm.engine.stats().tiers[0].hit_tokens == PROMPT_HIT


def test_other_formats_never_see_each_others_blocks(loaded, redis_server):
    options = {"redis_url": redis_server.url}
    with LLM(loaded=loaded, num_kv_blocks=POOL, kv_format="int8", **options) as llm:
        llm.generate(PROMPT, GREEDY)
        evict_everything(llm)
    with LLM(loaded=loaded, num_kv_blocks=POOL, **options) as llm:
        assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0


def test_random_workload_keeps_host_capacity_and_integrity(loaded, tmp_path):
    rng = random.Random(5)
    system = [rng.randrange(128) for _ in range(40)]
    docs = [[rng.randrange(128) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    prompts = [system + rng.choice(docs) + [rng.randrange(128) for _ in range(rng.randrange(1, 20))]
               for _ in range(16)]
    prompts += prompts[:8]          # repeats: hits on the device or in a tier
    block_nbytes = 2 * 2 * 16 * 2 * 16 * 4 + 64     # tiny model, fp32, with the header
    capacity = 5 * block_nbytes + 10                # 5 blocks: the host tier evicts all the time
    with LLM(loaded=loaded, num_kv_blocks=POOL, max_num_batched_tokens=32, max_num_seqs=3,
             host_cache_gb=capacity / 2**30, disk_cache_dir=str(tmp_path / "blocks")) as llm:
        engine = llm.engine
        host = offload(llm).store.tiers[0].store.transport
        assert host.capacity_bytes <= capacity
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            engine.check_integrity()
            assert host.nbytes_used <= host.capacity_bytes
        assert [done[i] for i in ids] == cold_batch(loaded, prompts)
        stats = engine.stats()
        assert stats.tier_hit_tokens > 0
        assert [t.tier for t in stats.tiers] == ["host", "disk"]


def test_cli_flags_reach_the_offload_config(tmp_path):
    from kvserve.cli import build_parser, engine_options
    from kvserve.config import DiskConfig, HostConfig, RedisConfig
    from kvserve.llm import engine_config

    args = build_parser().parse_args(["generate", "hi", "--host-cache-gb", "4", "--disk-cache", str(tmp_path),
                                      "--disk-cache-gb", "50", "--redis-url", "redis://h:6379/0",
                                      "--redis-ttl-s", "60"])
    host, disk, redis = engine_config(None, **engine_options(args)).tiers
    assert (host.capacity_bytes, disk.path, disk.capacity_bytes) == (4 << 30, str(tmp_path), 50 << 30)
    assert (redis.url, redis.ttl_s) == ("redis://h:6379/0", 60.0)
    assert (type(host), type(disk), type(redis)) == (HostConfig, DiskConfig, RedisConfig)
    assert engine_config(None).tiers == ()
    with pytest.raises(ValueError, match="redis url"):
        engine_config(None, redis_url="http://nope")
