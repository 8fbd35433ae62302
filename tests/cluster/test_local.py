"""``kvserve serve --replicas 2 --host 127.0.0.1`` as a user runs it: every socket its process
tree listens on (Ray's GCS, raylet, agents and workers, Serve's controller, proxy and
replicas) is on loopback, and after SIGTERM or SIGINT none of its processes is left within
``STOP_S`` (Ray's dashboard and runtime-env agents included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from offload.redis_server import free_port

from kvserve.cluster import procs
from kvserve.cluster.local_ray import LOCAL_ONLY_ENV, STOP_GRACE_S

pytest.importorskip("ray")

START_S = 240          # Ray, Serve, two replicas loading the model, on 2 shared cores
STOP_S = 60            # docs/cluster.md, "Stopping"


def wait_until(check, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"kvserve serve exited with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def serving(url: str) -> bool:
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_local_cluster_listens_on_loopback_only_and_leaves_nothing_once_stopped(tmp_path, signum):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != LOCAL_ONLY_ENV}      # the command sets it itself
    log = (tmp_path / "serve.log").open("wb")
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--replicas", "2", "--host", "127.0.0.1", "--port", str(port),
           "--num-kv-blocks", "32", "--max-model-len", "512", "--replica-cpus", "0.5", "--ray-num-cpus", "2",
           "--ray-object-store-mb", "96"]
    proc = subprocess.Popen(cmd, env={**env, "KVSERVE_API_KEY": ""}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tree: dict[int, int] = {}
    try:
        wait_until(lambda: serving(f"http://127.0.0.1:{port}"), START_S, proc)
        tree = {**procs.of([proc.pid]), **procs.descendants(proc.pid)}
        names = {(procs.PROC / str(p) / "comm").read_text().strip() for p in tree}
        assert {"gcs_server", "raylet"} <= names and len(tree) >= 8, names
        listening = procs.listeners(tree)
        assert any(x.port == port for x in listening)                      # the HTTP proxy
        assert len({x.pid for x in listening}) >= 6                         # Ray's and Serve's servers
        exposed = [x for x in listening if not x.is_loopback]
        assert exposed == [], [(x, (procs.PROC / str(x.pid) / "cmdline").read_bytes()[:60]) for x in exposed]
        assert b"listen beyond loopback" not in (tmp_path / "serve.log").read_bytes()

        start = time.monotonic()
        proc.send_signal(signum)
        proc.wait(STOP_S)
        while (procs.alive(tree) or procs.in_session(proc.pid)) and time.monotonic() - start < STOP_S:
            time.sleep(0.2)
        took = time.monotonic() - start
        assert procs.alive(tree) == [] and procs.in_session(proc.pid) == {}, (procs.alive(tree), took)
        print(f"{signal.Signals(signum).name}: {len(tree)} processes gone {took:.1f} s after it (grace {STOP_GRACE_S} s)")
        assert b"stopping the cluster" in (tmp_path / "serve.log").read_bytes()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        procs.stop({**tree, **procs.in_session(proc.pid)}, 0)
        log.close()
