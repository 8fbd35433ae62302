"""``kvserve serve --replicas``: its flags, and that the single server never imports Ray."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvserve.cli import build_parser, main


def test_the_single_server_path_does_not_import_ray():
    code = "import sys, kvserve.cli; kvserve.cli.build_parser(); print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_cluster_flags_parse():
    args = build_parser().parse_args(["serve", "--replicas", "3", "--ray-address", "auto", "--routing", "pow2",
                                      "--replica-cpus", "0.5", "--write-through", "--redis-url", "redis://h:1/0"])
    assert (args.replicas, args.ray_address, args.routing, args.replica_cpus) == (3, "auto", "pow2", 0.5)
    assert args.write_through is True
    assert build_parser().parse_args(["serve"]).replicas is None


def test_replicas_cannot_share_a_disk_directory(tmp_path, capsys):
    pytest.importorskip("ray")
    assert main(["serve", "--replicas", "2", "--disk-cache", str(tmp_path)]) == 2
    assert "one engine per directory" in capsys.readouterr().err


def test_cluster_flags_without_replicas_are_refused(capsys):
    assert main(["serve", "--routing", "pow2", "--replica-cpus", "0.5"]) == 2
    assert "--routing, --replica-cpus configure a cluster of engine replicas; give --replicas N" in capsys.readouterr().err


def test_cluster_flags_take_their_defaults():
    from kvserve.cluster.cli import CLUSTER_DEFAULTS, cluster_flags
    flags = cluster_flags(build_parser().parse_args(["serve", "--replicas", "2", "--routing", "pow2"]))
    assert vars(flags) == {**CLUSTER_DEFAULTS, "routing": "pow2"}
    flags = cluster_flags(build_parser().parse_args(["serve", "--replicas", "2", "--routing", "kv-prefix",
                                                     "--min-cached-share", "0.5"]))
    assert (flags.routing, flags.min_cached_share, CLUSTER_DEFAULTS["min_cached_share"]) == ("kv-prefix", 0.5, 0.2)


def test_a_share_outside_zero_to_one_is_refused():
    pytest.importorskip("ray")
    from kvserve.cluster.app import ClusterConfig
    with pytest.raises(ValueError, match="min_cached_share must be in"):
        ClusterConfig(min_cached_share=1.5)


def test_an_impossible_placement_is_refused_at_once_with_the_numbers(capsys):
    pytest.importorskip("ray")
    start = time.monotonic()
    assert main(["serve", "--replicas", "2", "--replica-cpus", "1", "--ray-num-cpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "2 replicas x 1 CPUs + 1 ingress x 0.25 CPUs = 2.25 CPUs, but the Ray cluster has 2" in err
    assert "--replica-cpus 0.87" in err and time.monotonic() - start < 30


def test_replicas_without_a_size_share_the_node():
    pytest.importorskip("ray")
    from kvserve.cluster.app import ClusterConfig
    from kvserve.cluster.cli import fit_cluster
    assert fit_cluster(ClusterConfig(num_replicas=2), 2, cpus_given=False).replica_cpus == 0.87
    assert fit_cluster(ClusterConfig(num_replicas=2), 16, cpus_given=False).replica_cpus == 1.0
    assert fit_cluster(ClusterConfig(num_replicas=2, replica_cpus=0.5), 2, cpus_given=True).replica_cpus == 0.5
    with pytest.raises(ValueError, match="give fewer --replicas"):
        fit_cluster(ClusterConfig(num_replicas=4), 0.25, cpus_given=False)
