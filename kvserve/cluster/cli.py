"""``kvserve serve --replicas N``: the flags of the cluster and its launch (docs/cluster.md).

Only ``run_cluster`` imports Ray: ``kvserve serve`` without ``--replicas`` never needs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from kvserve.cluster.index import DEFAULT_MIN_CACHED_SHARE, ROUTINGS
from kvserve.cluster.local_ray import check_local_ray, keep_ray_local, local_ray_options, stop_cluster, warn_if_exposed
from kvserve.server.cli import run_serve as serve_one
from kvserve.server.cli import serve_engine_options, server_settings
from kvserve.server.serving import ServerSettings

if TYPE_CHECKING:
    from kvserve.cluster.app import ClusterConfig



# the flags that only a cluster reads, with their defaults: None on the parser, so a flag given
# without --replicas is refused rather than ignored
CLUSTER_DEFAULTS: dict[str, Any] = {
    "ray_address": None, "routing": "kv", "replica_cpus": 1.0, "replica_gpus": 0.0, "ingress_replicas": 1,
    "max_load_imbalance": 2, "min_cached_share": DEFAULT_MIN_CACHED_SHARE, "routing_stats_period_s": 1.0,
    "max_ongoing_requests": 64, "ray_num_cpus": None, "ray_object_store_mb": 256, "ray_dashboard": False}


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """The cluster flags of ``kvserve serve``; its command runs the cluster when ``--replicas`` is given,
    else the single server (which refuses the other cluster flags)."""
    g = parser.add_argument_group("cluster: engine replicas on Ray Serve behind a KV-aware router (docs/cluster.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve (default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 or auto) instead of starting a local one")
    g.add_argument("--routing", choices=ROUTINGS,
                   help="kv: to the replica holding the most of the prompt's KV, its longest cached prefix and "
                        "its stored segments (default); kv-prefix: the prefix only; pow2: Serve's default")
    g.add_argument("--replica-cpus", type=float, help="Ray CPUs per engine replica (default 1)")
    g.add_argument("--replica-gpus", type=float, help="Ray GPUs per engine replica (default 0)")
    g.add_argument("--ingress-replicas", type=int, help="HTTP ingress replicas (default 1)")
    g.add_argument("--max-load-imbalance", type=int, metavar="REQUESTS",
                   help="ongoing requests the prefix holder may have beyond the least loaded replica (or a "
                        "quarter of that replica's, if more) before the router sends elsewhere (default 2)")
    g.add_argument("--min-cached-share", type=float, metavar="SHARE",
                   help="share of a prompt's blocks (segments counted) the best replica must hold for the router "
                        "to send it there; below, the request is new work and goes to the less loaded of two "
                        f"random replicas (default {DEFAULT_MIN_CACHED_SHARE})")
    g.add_argument("--routing-stats-period-s", type=float,
                   help="how often replicas publish the block keys they hold (default 1 s)")
    g.add_argument("--max-ongoing-requests", type=int,
                   help="requests one engine replica takes at once (default 64)")
    g.add_argument("--ray-num-cpus", type=float,
                   help="CPUs of a local Ray cluster (default: the machine's)")
    g.add_argument("--ray-object-store-mb", type=int,
                   help="object store of a local Ray cluster, MiB (default 256; outputs are small)")
    g.add_argument("--ray-dashboard", action="store_true", default=None,
                   help="start a local Ray cluster's dashboard too, on 127.0.0.1:8265 (default: none)")
    parser.set_defaults(run=run_serve)


def cluster_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The cluster flags, defaults filled in; ValueError naming those given without ``--replicas``."""
    given = {dest: getattr(args, dest) for dest in CLUSTER_DEFAULTS if getattr(args, dest) is not None}
    if args.replicas is None and given:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in given)
        raise ValueError(f"{flags} configure a cluster of engine replicas; give --replicas N, or drop them")
    return argparse.Namespace(**{**CLUSTER_DEFAULTS, **given})


def fit_cluster(cluster: ClusterConfig, available_cpus: float, cpus_given: bool) -> ClusterConfig:
    """``cluster`` placed on ``available_cpus`` Ray CPUs: replicas whose CPUs the user did not
    give share what the ingress leaves (at most 1 each); ValueError with the numbers, and the
    flag to change, when the replicas and the ingress cannot all be placed (Ray would wait
    for them forever)."""
    ingress = cluster.ingress_replicas * cluster.ingress_cpus
    fit = math.floor((available_cpus - ingress) / cluster.num_replicas * 100) / 100
    if not cpus_given and fit > 0:
        return dataclasses.replace(cluster, replica_cpus=min(1.0, fit))
    needed = cluster.num_replicas * cluster.replica_cpus + ingress
    if needed > available_cpus + 1e-9:
        hint = f"--replica-cpus {fit:g}" if fit > 0 else "fewer --replicas"
        raise ValueError(
            f"{cluster.num_replicas} replicas x {cluster.replica_cpus:g} CPUs + {cluster.ingress_replicas} ingress x "
            f"{cluster.ingress_cpus:g} CPUs = {needed:g} CPUs, but the Ray cluster has {available_cpus:g}: it would wait "
            f"for them forever; give {hint} (or a larger --ray-num-cpus / cluster)")
    return cluster


def run_serve(args: argparse.Namespace) -> int:
    flags = cluster_flags(args)
    if args.replicas is None:
        return serve_one(args)
    return run_cluster(args, flags, server_settings(args))


def run_cluster(args: argparse.Namespace, flags: argparse.Namespace, settings: ServerSettings) -> int:
    started_ray = flags.ray_address is None
    if started_ray:
        keep_ray_local()        # before Ray is imported: it reads the switch once (cluster/local_ray.py)
    import ray
    from ray import serve

    from kvserve.cluster.app import APP_NAME, ClusterConfig, build_application

    cluster = ClusterConfig(num_replicas=args.replicas, replica_cpus=flags.replica_cpus,
                            replica_gpus=flags.replica_gpus, ingress_replicas=flags.ingress_replicas,
                            routing=flags.routing, max_imbalance=flags.max_load_imbalance,
                            min_cached_share=flags.min_cached_share,
                            stats_period_s=flags.routing_stats_period_s, max_ongoing_requests=flags.max_ongoing_requests)
    cpus_given = args.replica_cpus is not None
    options = serve_engine_options(args)
    if options.get("disk_cache_dir") and cluster.num_replicas > 1:
        # a disk tier directory belongs to one engine (it holds a lock); replicas would share it
        raise ValueError("--disk-cache cannot be given to several replicas (one engine per directory); "
                         "share blocks through --redis-url and --write-through instead")
    if started_ray:      # a local cluster's CPUs are known before it starts: refuse without starting it
        cluster = fit_cluster(cluster, flags.ray_num_cpus or os.cpu_count() or 1, cpus_given)
    # SIGTERM unwinds like Ctrl-C from here on: the finally below stops Serve, a Ray this process
    # started and what is left of its processes, even while Ray or a deployment is coming up
    signal.signal(signal.SIGTERM, _interrupt)
    serve_started = False
    try:
        if started_ray:
            ray.init(**local_ray_options(flags.ray_num_cpus, flags.ray_object_store_mb, flags.ray_dashboard))
        else:
            ray.init(address=flags.ray_address)
        # ray.init puts its own SIGTERM handler in (sys.exit), under which the driver aborts (SIGABRT)
        # halfway through deleting the application, leaving Ray's processes behind: ours again
        signal.signal(signal.SIGTERM, _interrupt)
        if started_ray:
            check_local_ray()
        else:
            cluster = fit_cluster(cluster, ray.cluster_resources().get("CPU", 0.0), cpus_given)
        app = build_application(args.model, options, settings, cluster)
        serve_started = True
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        if started_ray:
            warn_if_exposed(args.host)
        print(f"kvserve: {cluster.num_replicas} engine replicas ({cluster.routing} routing) serving on "
              f"http://{args.host}:{args.port}", flush=True)
        wait_for_signal()
    except KeyboardInterrupt:
        pass
    finally:
        # a second Ctrl-C or SIGTERM must not cut the stop short: it would leave Ray running
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("kvserve: stopping the cluster", flush=True)
        stop_cluster(APP_NAME, started_ray, serve_started)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM (both raise KeyboardInterrupt here, see ``run_cluster``)."""
    threading.Event().wait()
