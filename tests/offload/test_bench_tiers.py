"""``kvserve bench tiers`` end to end on the default model, with a workload small enough
for a test: every configuration replays the same prompts, and the tiers serve the
histories the small device pool evicted."""

from __future__ import annotations

import json

import pytest

from kvserve.bench.tiers import break_even_blocks
from kvserve.cli import main
from kvserve.offload.cost import CostSnapshot, TierCost

ANIMALS = ["fox", "owl", "cat", "hen", "elk", "bee", "yak", "ram", "cod", "emu"]
PLACES = ["river", "hill", "barn", "field", "wood", "lake", "road", "town", "shore", "mill"]


def story() -> str:
    """Distinct sentences of 12 words (no outside text file): 9 passages and a spare."""
    return " ".join(f"The {a} walked to the {p} and saw {n} small stones there."
                    for n, (a, p) in enumerate(zip(ANIMALS, PLACES), start=2))


def test_bench_tiers_serves_evicted_histories_from_host(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    text = tmp_path / "story.txt"
    text.write_text(story())
    # 0.01 GiB of fp32 KV = 14 blocks of 16 tokens: three conversations do not fit
    assert main(["bench", "tiers", "--conversations", "3", "--turns", "3", "--words-per-turn", "12",
                 "--max-tokens", "4", "--kv-cache-gb", "0.01", "--kv-format", "native", "--tiers", "host", "--text", str(text),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recompute only" in text and "break-even blocks" in text and "runs loaded/cut/probed" in text
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["recompute only", "host"]
    base, host = results
    assert base["requests"] == host["requests"] == 9
    assert [t["prompt_tokens"] for t in base["turns"]] == [t["prompt_tokens"] for t in host["turns"]]
    assert base["tier_hit_rates"] == {}
    assert host["tier_hit_rates"]["host"] > 0
    assert host["computed_rate"] < base["computed_rate"]
    # first turns have nothing to load: the same cached tokens (the system prompt) either way
    firsts = [(b["cached_tokens"], h["cached_tokens"]) for b, h in zip(base["turns"], host["turns"])
              if b["turn"] == 0]
    assert all(b == h for b, h in firsts)
    assert host["runs_loaded"] >= 1 and host["tiers"][0]["tier"] == "host"


def test_bench_tiers_rejects_an_unknown_tier(capsys):
    assert main(["bench", "tiers", "--tiers", "host,tape", "--conversations", "1", "--turns", "1"]) == 2
    assert "unknown tier 'tape' in --tiers; use host, disk, redis" in capsys.readouterr().err


def test_break_even_blocks():
    cost = CostSnapshot(prefill_tokens_per_s=1600.0, tiers=(), runs_loaded=0, runs_cut=0, blocks_recomputed=0)
    # recompute 16 tokens: 10 ms; read 1 MB at 1 GB/s: 1 ms; 9 ms saved per block, 45 ms latency
    tier = TierCost(tier="disk", latency_s=0.045, bytes_per_s=1e9, is_measured=True)
    assert break_even_blocks(tier, cost, 16, 1_000_000) == pytest.approx(5.0)
    # reading a block takes as long as recomputing it (10 ms): never worth it
    slow = TierCost(tier="redis", latency_s=0.001, bytes_per_s=1e8, is_measured=True)
    assert break_even_blocks(slow, cost, 16, 1_000_000) == float("inf")
    unmeasured = CostSnapshot(prefill_tokens_per_s=None, tiers=(), runs_loaded=0, runs_cut=0, blocks_recomputed=0)
    assert break_even_blocks(tier, unmeasured, 16, 1_000_000) is None
