"""The process-tree reading behind the local cluster's checks (kvserve/cluster/procs.py), on
sockets and processes made here: no Ray."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from kvserve.cluster import procs
from kvserve.cluster.local_ray import LOCAL_ONLY_ENV, local_ray_options


def test_listeners_are_read_with_their_addresses_and_loopback_told_apart():
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    wide = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    wide.bind(("::", 0))
    wide.listen()
    udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    udp.bind(("::1", 0))
    try:
        found = {(x.protocol, x.address, x.port): x.is_loopback for x in procs.listeners([os.getpid()])}
        assert found[("tcp", "127.0.0.1", tcp.getsockname()[1])] is True
        assert found[("tcp6", "::", wide.getsockname()[1])] is False
        assert found[("udp6", "::1", udp.getsockname()[1])] is True
        assert procs.Listener(1, "tcp6", "::ffff:127.0.0.1", 1).is_loopback
        assert not procs.Listener(1, "tcp", "0.0.0.0", 1).is_loopback
    finally:
        for s in (tcp, wide, udp):
            s.close()


def test_a_tree_is_listed_and_stopped_even_when_it_ignores_sigterm():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"1\n"     # its handler is in place
    tree = procs.descendants(os.getpid())
    assert child.pid in tree and child.pid in procs.alive(tree)
    assert procs.stop({child.pid: tree[child.pid]}, grace_s=0.5) == [child.pid]    # SIGKILL, after the grace
    child.wait(10)
    assert procs.alive({child.pid: tree[child.pid]}) == []
    assert procs.alive({child.pid: tree[child.pid] + 1}) == []               # another start time: not it


def test_a_local_clusters_ray_options_keep_it_on_loopback():
    options = local_ray_options(2, 96)
    assert options["_node_ip_address"] == "127.0.0.1" and options["include_dashboard"] is False
    runtime = options["runtime_env"]
    assert runtime["env_vars"][LOCAL_ONLY_ENV] == "0"
    assert runtime["worker_process_setup_hook"] == "kvserve.cluster.local_ray.bind_serve_to_loopback"
    dashboard = local_ray_options(2, 96, dashboard=True)
    assert (dashboard["include_dashboard"], dashboard["dashboard_host"]) == (True, "127.0.0.1")
