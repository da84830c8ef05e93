"""CPU time by process role, from ``/proc``: what an engine's processes spend beside its worker.

Tokens per second move with this host's memory bandwidth from minute to minute; CPU seconds per
token barely do, so they show a change in the controller's or the client's share that a
throughput ratio would hide in noise. Linux only (reads ``/proc/PID/stat``).
"""

from __future__ import annotations

import os
from collections import defaultdict

__all__ = ["ROLES", "cpu_by_role", "cpu_seconds"]

ROLES = ("worker", "controller", "client", "ray services")
"""``worker``: Ray worker actors; ``controller``: the controller actor; ``client``: the calling
process (the whole engine with ``backend="local"``); ``ray services``: raylet, GCS, dashboard
and log processes."""


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's role (or ``""``) and CPU seconds so far (user + system, all threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    out: dict[int, tuple[str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (_role(pid, me, cmd), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _role(pid: int, me: int, cmd: str) -> str:
    if pid == me:
        return "client"
    if cmd.startswith("ray::RayWorker"):
        return "worker"
    if cmd.startswith("ray::Controller"):
        return "controller"
    if "/ray/" in cmd or cmd.startswith("ray::"):
        return "ray services"
    return ""


def cpu_by_role(before: dict[int, tuple[str, float]],
                after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two ``cpu_seconds()`` snapshots (a process that started in
    between counts from zero)."""
    spent: dict[str, float] = defaultdict(float)
    for pid, (role, secs) in after.items():
        if role:
            spent[role] += secs - before.get(pid, (role, 0.0))[1]
    return {role: spent[role] for role in ROLES}
