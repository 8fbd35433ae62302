"""``kvserve bench cluster``'s ``--json`` and ``--plot`` on made-up runs, ``bench cluster-rag``'s
queries and metrics reading (no server, no Ray)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.bench import cluster, cluster_rag, plots
from kvserve.bench.cli import add_bench_parser

SUMMARY_FIELDS = {"name", "ttft_s", "prompt_tokens", "cached_tokens", "wall_s", "load_before", "load_after",
                  "routed_to_holder", "tier_hit_tokens", "errors", "hit_rate", "ttft_mean_s", "ttft_p50_s",
                  "ttft_p95_s"}


def runs() -> list[cluster.Run]:
    return [cluster.Run("single", [0.1, 0.3, 0.2], 1000, 850, 29.2, 1.8, 1.5, None, {"device": 850.0}),
            cluster.Run("kv", [0.2, 0.4, 0.3], 1000, 850, 37.9, 1.5, 1.6, 1.0, {"device": 300.0, "redis": 550.0}),
            cluster.Run("pow2", [0.5, 0.4, 0.6], 1000, 700, 44.4, 1.4, 1.6, 0.5, {"device": 700.0})]


def parse(tmp_path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "cluster", "--configs", "single,kv,pow2", "--json", str(tmp_path / "c.json"),
                              "--plot", str(tmp_path / "c.png")])


def test_json_holds_the_settings_and_each_runs_summary(tmp_path):
    args = parse(tmp_path)
    assert args.run is cluster.run_bench
    payload = json.loads(json.dumps(cluster.results_json(args, [r.summary() for r in runs()])))
    assert set(payload) == {"benchmark", "args", "runs"}
    assert payload["benchmark"] == "cluster"
    assert payload["args"]["configs"] == "single,kv,pow2"
    assert (payload["args"]["json"], payload["args"]["plot"]) == (str(tmp_path / "c.json"), str(tmp_path / "c.png"))
    assert "run" not in payload["args"] and "model" not in payload["args"]    # a function; None
    assert [r["name"] for r in payload["runs"]] == ["single", "kv", "pow2"]
    for r in payload["runs"]:
        assert set(r) == SUMMARY_FIELDS
    kv = payload["runs"][1]
    assert (kv["hit_rate"], kv["ttft_p50_s"], kv["routed_to_holder"]) == (0.85, 0.3, 1.0)
    assert kv["tier_hit_tokens"] == {"device": 300.0, "redis": 550.0}


def test_plot_draws_the_summaries_as_a_png(tmp_path):
    args = parse(tmp_path)
    path = plots.plot_cluster([r.summary() for r in runs()], args.plot)
    assert path == tmp_path / "c.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_rag_users_ask_about_their_own_documents_in_new_orders():
    queries = cluster_rag.user_queries(num_users=3, docs_per_user=4, k=3, queries_per_user=5, seed=1)
    assert [len(qs) for qs in queries] == [5, 5, 5]
    for u, qs in enumerate(queries):
        for q in qs:
            assert len(set(q.doc_ids)) == 3 and set(q.doc_ids) <= set(range(4 * u, 4 * u + 4))
            assert q.target in q.doc_ids
    assert len({q.doc_ids for q in queries[0]}) > 1                     # orders differ
    assert queries == cluster_rag.user_queries(3, 4, 3, 5, seed=1)
    with pytest.raises(ValueError, match="k must be in 1..4"):
        cluster_rag.user_queries(3, 4, 5, 5, seed=1)


def test_rag_reads_the_segment_counters_of_either_server():
    fleet = ('kvserve_cluster_replica_segment_tokens_total{kind="reused",replica="a"} 100.0\n'
             'kvserve_cluster_replica_segment_tokens_total{kind="stored",replica="a"} 80.0\n'
             'kvserve_cluster_replica_segment_tokens_total{kind="reused",replica="b"} 50.0\n'
             'kvserve_cluster_replica_segment_tokens_total{kind="stored",replica="b"} 16.0\n'
             "kvserve_cluster_routed_to_holder_ratio 0.75\n# HELP x y")
    run = cluster_rag.RagRun("kv")
    cluster_rag.read_metrics(fleet, run, single=False)
    assert (run.reused_tokens, run.stored_tokens, run.routed_to_holder) == (150.0, 96.0, 0.75)
    one = cluster_rag.RagRun("single")
    cluster_rag.read_metrics("kvserve_segment_stored_tokens_total 48.0\nkvserve_blend_reused_tokens_total 64.0\n"
                             "kvserve_segment_stored_tokens_created 1.7e9", one, single=True)
    assert (one.reused_tokens, one.stored_tokens, one.routed_to_holder) == (64.0, 48.0, None)
    text = cluster_rag.report([cluster_rag.RagRun("kv", [0.4, 0.6], stored_tokens=96.0),
                               cluster_rag.RagRun("pow2", [1.0, 1.0], stored_tokens=300.0)], 2)
    assert "mean TTFT pow2 / kv = 2.00x; segment tokens computed 300 vs 96" in text
