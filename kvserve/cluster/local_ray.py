"""A Ray cluster that ``kvserve serve --replicas`` starts on this machine: on loopback only,
and stopped whole.

Ray 2.60's ``ray.init(_node_ip_address="127.0.0.1")`` turns a loopback address into the
machine's own (``services.resolve_ip_for_localhost``), and its GCS, raylet, workers and agents
then listen on every interface or on that address. Ray keeps everything on loopback only in
its single-machine mode, chosen once, when Ray is imported, by ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
(the mode it runs in on macOS and Windows): set to 0, the node address is 127.0.0.1 and every
Ray process binds there. ``keep_ray_local`` sets it (the processes Ray starts inherit it);
``check_local_ray`` refuses a Ray that came up on another address (one imported before the
switch was set); ``warn_if_exposed`` reads what the process tree listens on once it serves.
One server is left: each Serve replica's inter-deployment gRPC server, which Ray Serve 2.60
binds to ``[::]:0`` whatever the node address (``ray/serve/_private/replica.py``). Ray's own
hook for configuring its workers, the runtime environment's ``worker_process_setup_hook``,
runs ``bind_serve_to_loopback`` in each worker of a local cluster, which binds that server to
127.0.0.1 instead (its clients reach it at the node address, 127.0.0.1).

Stopping: ``ray.shutdown`` stops what the driver started, but Ray's dashboard and runtime-env
agents (children of the raylet) may outlive it, ignoring SIGTERM. ``stop_cluster`` lists the
process tree first, and ends what is left of it after Serve and Ray stopped: SIGTERM, then
SIGKILL ``STOP_GRACE_S`` later.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

from kvserve.cluster import procs

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"      # "0": Ray's single-machine mode, loopback
LOOPBACK = "127.0.0.1"
DASHBOARD_PORT = 8265
STOP_GRACE_S = 5.0


def keep_ray_local() -> None:
    """Put Ray, when imported after this, in its single-machine mode (everything on loopback)."""
    os.environ[LOCAL_ONLY_ENV] = "0"


def local_ray_options(num_cpus: float | None, object_store_mb: int, dashboard: bool = False) -> dict[str, Any]:
    """``ray.init`` options of a one-machine cluster: loopback node address, no dashboard unless
    asked (then on loopback), a small object store, and this kvserve on the workers' path (the
    replicas import it)."""
    import kvserve

    source = str(Path(kvserve.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    options: dict[str, Any] = {"num_cpus": num_cpus, "object_store_memory": object_store_mb << 20,
                               "include_dashboard": dashboard, "_node_ip_address": LOOPBACK,
                               "runtime_env": {"env_vars": {"PYTHONPATH": path, LOCAL_ONLY_ENV: "0"},
                                               "worker_process_setup_hook": f"{__name__}.bind_serve_to_loopback"}}
    if dashboard:
        options |= {"dashboard_host": LOOPBACK, "dashboard_port": DASHBOARD_PORT}
    return options


def bind_serve_to_loopback() -> None:
    """In a worker of a local cluster (its setup hook): the gRPC server a Serve replica opens for
    calls from other deployments binds to 127.0.0.1, not to every interface. A Ray without that
    function changes nothing here (and ``warn_if_exposed`` says what listens where)."""
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        return

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return int(bind(server, f"{LOOPBACK}:{port}" if host in ("[::]", "0.0.0.0", "") else address))

    replica.add_port_to_grpc_server = on_loopback


def check_local_ray() -> None:
    """ValueError (after stopping it) when the Ray this process started has a node address
    other than loopback: its processes would listen beyond this machine."""
    import ray

    address = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(address).is_loopback:
        ray.shutdown()
        raise ValueError(f"the local Ray cluster came up on {address}, not on loopback: Ray was imported before "
                         f"{LOCAL_ONLY_ENV}=0 was set; set it in the environment (or start Ray yourself and give "
                         "--ray-address)")


def warn_if_exposed(host: str) -> None:
    """Print what this process tree listens on beyond loopback, when the server was asked for
    loopback only (``--host``): a check of the above, on every start."""
    if not ipaddress.ip_address(host).is_loopback:
        return
    exposed = [x for x in procs.listeners([os.getpid(), *procs.descendants(os.getpid())]) if not x.is_loopback]
    if exposed:
        print("kvserve: warning: these processes of the cluster listen beyond loopback: "
              + ", ".join(f"pid {x.pid} {x.protocol} {x.address}:{x.port}" for x in exposed), flush=True)


def stop_cluster(app_name: str, started_ray: bool, serve_started: bool = True) -> None:
    """Delete the Serve application (when Serve was started); when this process started Ray,
    stop Serve and Ray and then whatever of its process tree is left. Each step runs whatever
    the one before raised."""
    import ray
    from ray import serve

    tree = procs.descendants(os.getpid()) if started_ray else {}
    steps = [lambda: serve.delete(app_name)] if serve_started else []
    if started_ray:
        steps += [serve.shutdown, ray.shutdown]
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - stopping goes on: the processes must end
            print(f"kvserve: while stopping: {type(e).__name__}: {e}", flush=True)
    killed = procs.stop(tree, STOP_GRACE_S)
    if killed:
        print(f"kvserve: {len(killed)} processes of the cluster outlived Ray's shutdown and SIGTERM; "
              f"SIGKILLed after {STOP_GRACE_S:g} s", flush=True)
