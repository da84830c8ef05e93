"""Test hosts on one machine: Linux network namespaces joined by a bridge, each with its own
IP, home directory and Ray temp dir, and a real Ray node started in it with ``ray start``.

What makes them hosts rather than fake nodes (``ray.cluster_utils.Cluster``): every node has its
own address on its own interface (``lan0``), the host name still resolves to loopback (this
machine's ``/etc/hosts``, as on many Debian and Ubuntu images), and nothing is shared through
the home directory (each host's ``~/.ray/auth_token`` is its own copy) or the temp dir (Ray's
session directory has the same path on every node, as on real hosts, but each host's processes
see their own copy of it: a bind mount in the mount namespace ``ip netns exec`` makes).

- ``TestNet.create(n)`` makes the bridge ``<prefix>-br`` (10.77.T.254/24 in the root namespace,
  T fixed per checkout) and hosts ``<prefix>-h1 .. hn`` at 10.77.T.1 .. n; ``add_host()`` adds
  one more later.
- ``host.run(cmd)`` / ``host.popen(cmd)`` run a command inside a host, with its environment.
- ``host.kill_all()`` SIGKILLs every process in the host's namespace, by pid (``ip netns
  pids``): the processes ``ray start`` leaves behind are daemons, not our children.
- ``TestNet.destroy()`` kills every host's processes and deletes every namespace, link and
  per-namespace config; it is safe to call at any stage, and ``leftovers()`` says what is left.

Each namespace gets ``/etc/netns/<ns>/resolv.conf`` (iproute2 bind-mounts it over
``/etc/resolv.conf`` for ``ip netns exec``) naming a resolver on the host's own loopback: the
machine's real resolver is unreachable from the test network, and every reverse lookup of a
peer (the TCPStore does one per connection) would otherwise wait out the resolver timeout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.kernels.cpu import extensions_root

# One prefix and subnet per checkout, so that suites run from two checkouts on one machine
# neither collide nor clean up each other's hosts (only this prefix's leftovers are removed).
_TAG = int(hashlib.sha1(str(Path(__file__).resolve().parents[2]).encode()).hexdigest(), 16) % 200
PREFIX = f"psmh{_TAG + 20}"
SUBNET = f"10.77.{_TAG + 20}"
BRIDGE_IP = f"{SUBNET}.254"
ROOT = Path("/tmp") / PREFIX  # short: Ray's unix socket paths live below it
LOCAL = ROOT / "local"  # each host's private view (see Host.argv)
VENV_BIN = str(Path(sys.executable).parent)
EXTENSIONS = str(extensions_root())  # the test process's, resolved before any HOME is swapped


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, no netns support), or None."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2 (`ip`)"
    probe = f"{PREFIX}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Every network namespace of this suite (name starting with the prefix)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]


def netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


@dataclass
class Host:
    """One test host: a namespace, an address, a home and a Ray temp dir of its own."""

    name: str
    index: int
    ns: str
    ip: str
    home: Path
    env: dict[str, str] = field(default_factory=dict)

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.home),
            # The compiled CPU kernels from the test process's own cache: with a home of its own
            # each host would compile them again, a minute or more of two shared cores per host
            # per cluster. The build folder is keyed by sources, flags, torch and CPU, and lands
            # by one rename (kernels/cpu.py), so hosts that share it cannot see half a build.
            "TORCH_EXTENSIONS_DIR": EXTENSIONS,
            "RAY_TMPDIR": str(LOCAL),
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "LANG": "C.UTF-8",
            **self.env,
        }
        env.update(extra or {})
        return env

    @property
    def local(self) -> Path:
        """This host's own disk, seen by its processes at ``LOCAL``."""
        return ROOT / self.name / "local"

    def argv(self, cmd: str | Sequence[str]) -> list[str]:
        shell = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        # `ip netns exec` gives the command a mount namespace of its own: bind this host's
        # directory over LOCAL there, so that each host has a private Ray temp dir.
        prelude = f'mount --bind {self.local} {LOCAL} && exec "$@"'
        return ["ip", "netns", "exec", self.ns, "bash", "-c", prelude, "bash", *shell]

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        timeout: float = 120.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.argv(cmd), env=self.environ(env), cwd=cwd, capture_output=True, text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"[{self.name}] {cmd!r} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                f"\n--- stderr\n{proc.stderr[-4000:]}"
            )
        return proc

    def popen(
        self, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None, **kwargs: object,
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            self.argv(cmd), env=self.environ(env), cwd=cwd, text=True, start_new_session=True,
            **kwargs,
        )

    def pids(self) -> list[int]:
        return netns_pids(self.ns)

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in this host's namespace, by pid, until none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


class TestNet:
    """The bridge and the hosts on it (see the module docstring)."""

    def __init__(self) -> None:
        self.bridge = f"{PREFIX}-br"
        self.hosts: list[Host] = []

    @classmethod
    def create(cls, n: int) -> TestNet:
        cleanup_stale()
        net = cls()
        try:
            ROOT.mkdir(parents=True, exist_ok=True)
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{BRIDGE_IP}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for _ in range(n):
                net.add_host()
        except BaseException:
            net.destroy()
            raise
        return net

    def add_host(self) -> Host:
        i = len(self.hosts) + 1
        name = f"h{i}"
        ns = f"{PREFIX}-{name}"
        host = Host(name, i, ns, f"{SUBNET}.{i}", ROOT / name / "home")
        self.hosts.append(host)  # before any step, so that destroy() finds what was made
        host.home.mkdir(parents=True, exist_ok=True)
        host.local.mkdir(parents=True, exist_ok=True)
        LOCAL.mkdir(parents=True, exist_ok=True)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")
        veth = f"{PREFIX}-v{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "lan0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        for args in (
            ("link", "set", "lo", "up"),
            ("addr", "add", f"{host.ip}/24", "dev", "lan0"),
            ("link", "set", "lan0", "up"),
            # A default route, so that Ray's own guess of the node IP (the source address of
            # a route to the outside) finds lan0, as it would on a real host.
            ("route", "add", "default", "via", BRIDGE_IP),
        ):
            _ip("-n", ns, *args)
        return host

    def destroy(self) -> None:
        for host in reversed(self.hosts):
            host.kill_all()
            _ip("netns", "del", host.ns, check=False)
            _ip("link", "del", f"{PREFIX}-v{host.index}", check=False)
            shutil.rmtree(Path("/etc/netns") / host.ns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(ROOT, ignore_errors=True)


def cleanup_stale() -> None:
    """Remove what an earlier run killed half-way left behind (same prefix)."""
    for ns in namespaces():
        for pid in netns_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    out = _ip("-o", "link", "show", check=False).stdout
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0] if ":" in line else ""
        if name.startswith(f"{PREFIX}-"):
            _ip("link", "del", name, check=False)
    shutil.rmtree(ROOT, ignore_errors=True)


def leftovers() -> list[str]:
    """What of this suite still exists: namespaces, links, processes under its temp root."""
    left = [f"namespace {ns}" for ns in namespaces()]
    out = _ip("-o", "link", "show", check=False).stdout
    left += [f"link {line.split(':', 2)[1].strip()}" for line in out.splitlines()
             if f" {PREFIX}-" in line]
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    left += [f"process {line.strip()[:120]}" for line in ps.splitlines() if str(ROOT) in line
             and "ps -eo" not in line]
    return left
