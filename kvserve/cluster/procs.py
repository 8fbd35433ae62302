"""A process tree on Linux, read from /proc: its processes, the sockets they listen on, and
stopping what is left of it.

What a local cluster started (Ray's GCS, raylet, agents, workers, the Serve actors) hangs below
the ``kvserve serve`` process; ``kvserve serve`` lists that tree before it stops Ray and ends
what outlived ``ray.shutdown`` (Ray's dashboard and runtime-env agents may ignore SIGTERM).
The tests read the same tree's listening sockets to see that a local cluster stays on loopback.

    /proc/<pid>/stat         state, parent pid, session id, start time (a pid with another start
                             time is another process: pids are reused)
    /proc/<pid>/fd/*         "socket:[inode]" for each socket the process holds
    /proc/net/{tcp,tcp6}     listening TCP sockets (state 0A) by inode: address and port
    /proc/net/{udp,udp6}     bound UDP sockets with no peer, by inode
"""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class Listener(NamedTuple):
    pid: int
    protocol: str       # tcp, tcp6, udp, udp6
    address: str        # as bound: 127.0.0.1, ::, ::ffff:127.0.0.1, ...
    port: int

    @property
    def is_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in LOOPBACK)


class _Stat(NamedTuple):
    state: str
    parent: int
    session: int
    start_ticks: int


def _stat(pid: int) -> _Stat | None:
    """What /proc/<pid>/stat says; None when the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()      # after "pid (comm) ": state ppid pgrp session ... starttime
    return _Stat(fields[0], int(fields[1]), int(fields[3]), int(fields[19]))


def _pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


Procs = Mapping[int, int]          # pid -> its start time (clock ticks since boot): processes, not pids


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` (children, theirs, ...), now."""
    stats = {p: s for p in _pids() if (s := _stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for p, s in stats.items():
        children.setdefault(s.parent, []).append(p)
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = stats[child].start_ticks
            todo.append(child)
    return out


def of(pids: Iterable[int]) -> dict[int, int]:
    """``pids`` as processes (those running now)."""
    return {p: s.start_ticks for p in pids if (s := _stat(p)) is not None}


def in_session(session_id: int) -> dict[int, int]:
    """The processes of session ``session_id`` (a process started with ``start_new_session``
    and everything it started that did not leave the session)."""
    return {p: s.start_ticks for p in _pids() if (s := _stat(p)) is not None and s.session == session_id}


def alive(procs: Procs) -> list[int]:
    """The pids of those of ``procs`` still running (zombies count as gone, and so does a pid
    that now names another process)."""
    return [pid for pid, start in procs.items()
            if (s := _stat(pid)) is not None and s.start_ticks == start and s.state != "Z"]


def listeners(pids: Iterable[int]) -> list[Listener]:
    """The sockets ``pids`` listen on: TCP in LISTEN, UDP bound with no peer."""
    table = _socket_table()
    out = []
    for pid in pids:
        try:
            fds = list((PROC / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                found = table.get(int(target[8:-1]))
                if found is not None:
                    out.append(Listener(pid, *found))
    return out


def _socket_table() -> dict[int, tuple[str, str, int]]:
    """inode -> (protocol, address, port) of every listening socket in this network namespace."""
    table = {}
    for protocol, listening in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        try:
            lines = (PROC / "net" / protocol).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            if state != listening or (protocol.startswith("udp") and not remote.endswith(":0000")):
                continue
            address, port = local.split(":")
            table[inode] = (protocol, _address(address), int(port, 16))
    return table


def _address(hex_address: str) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    swapped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(swapped))


def stop(procs: Procs, grace_s: float) -> list[int]:
    """SIGTERM to those of ``procs`` still running, SIGKILL to those that outlive ``grace_s``
    seconds; returns the pids that needed SIGKILL."""
    for pid in alive(procs):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = alive(procs)
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    return killed


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
