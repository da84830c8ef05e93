"""Which network interface a rank's collectives use: the one that carries its Ray node IP.

gloo (and NCCL's socket transport) bind to the address the host name resolves to unless told
otherwise. On many Debian and Ubuntu images ``/etc/hosts`` maps the host name to 127.0.0.1 or
127.0.1.1, so a rank on one host advertises loopback to its peers on another and the full-mesh
connect fails. Ray's node IP is the address the other nodes already reach this one at, so the
interface that carries it is the one to bind; a user who set ``GLOO_SOCKET_IFNAME`` or
``NCCL_SOCKET_IFNAME`` keeps that choice.

Standard library only (Linux ``ioctl`` and ``/proc``), so it runs in any worker process.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Mapping, MutableMapping, Sequence

__all__ = [
    "IFNAME_VARIABLES",
    "NoUsableInterfaceError",
    "bind_collectives",
    "interface_addresses",
    "interface_for_address",
]

GLOO_VAR = "GLOO_SOCKET_IFNAME"
NCCL_VAR = "NCCL_SOCKET_IFNAME"
IFNAME_VARIABLES = (GLOO_VAR, NCCL_VAR)

_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux: 16 bytes of name, a 24-byte union


class NoUsableInterfaceError(RuntimeError):
    """No network interface of this node carries the address its peers were told to use."""

    def __init__(self, node: str, address: str, interfaces: Mapping[str, Sequence[str]]) -> None:
        seen = "; ".join(f"{n}: {', '.join(a) or '-'}" for n, a in sorted(interfaces.items()))
        super().__init__(
            f"node {node}: no network interface carries the address {address} that the other "
            f"ranks connect to (interfaces: {seen or 'none found'}). Set {GLOO_VAR} (and "
            f"{NCCL_VAR} on GPU nodes) to the interface the nodes reach each other on, in the "
            "environment of `ray start` on every node, or start the node with "
            "`ray start --node-ip-address=<an address of that interface>`."
        )
        self.node = node
        self.address = address
        self.interfaces = {k: list(v) for k, v in interfaces.items()}

    def __reduce__(self) -> tuple[object, ...]:  # raised inside a Ray actor, pickled back
        return (type(self), (self.node, self.address, self.interfaces))


def _ipv4_addresses() -> dict[str, list[str]]:
    """Every IPv4 address by interface, aliases included (SIOCGIFCONF lists them all, where
    SIOCGIFADDR would give only an interface's first)."""
    found: dict[str, list[str]] = {}
    size = _IFREQ_SIZE * 64
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while True:
            buf = array.array("B", bytes(size))
            addr, _ = buf.buffer_info()
            req = struct.pack("iL", size, addr)
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, req))[0]
            if used < size:  # a full buffer may have been cut short: ask again with more room
                break
            size *= 2
    raw = buf.tobytes()
    for off in range(0, used, _IFREQ_SIZE):
        # An alias is labelled "eth0:1"; the device the collectives bind to is "eth0".
        name = raw[off : off + 16].split(b"\0", 1)[0].decode().split(":", 1)[0]
        ip = socket.inet_ntoa(raw[off + 20 : off + 24])  # sockaddr_in: family, port, addr
        found.setdefault(name, []).append(ip)
    return found


def _ipv6_addresses(path: str = "/proc/net/if_inet6") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:  # no IPv6 on this host
        return found
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            ip = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
            found.setdefault(fields[5], []).append(ip)
    return found


def interface_addresses() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 and IPv6 addresses."""
    found = _ipv4_addresses()
    for name, ips in _ipv6_addresses().items():
        found.setdefault(name, []).extend(ips)
    return found


def interface_for_address(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface among ``interfaces`` that carries ``address``, or None."""
    want = ipaddress.ip_address(address.strip("[]"))
    for name in sorted(interfaces):
        for ip in interfaces[name]:
            try:
                if ipaddress.ip_address(ip.split("%", 1)[0]) == want:
                    return name
            except ValueError:
                continue
    return None


def bind_collectives(
    address: str,
    *,
    node: str,
    env: MutableMapping[str, str] | None = None,
    list_interfaces: Callable[[], Mapping[str, Sequence[str]]] = interface_addresses,
) -> dict[str, str]:
    """Point gloo and NCCL at the interface that carries ``address`` (this rank's node IP, or
    127.0.0.1 when the whole group shares one host), unless the user already named one.

    Must run before the process group (and any subgroup) is created: both libraries read the
    variables when a group builds its transport. Returns the variables it set. Raises
    ``NoUsableInterfaceError`` (naming ``node``, the address and the variable to set) when no
    interface carries the address and the user left a variable unset.
    """
    env = os.environ if env is None else env
    unset = [var for var in IFNAME_VARIABLES if not env.get(var)]
    if not unset:
        return {}
    interfaces = list_interfaces()
    name = interface_for_address(address, interfaces)
    if name is None:
        raise NoUsableInterfaceError(node, address, interfaces)
    # NCCL matches interface names by prefix ("eth1" would also pick "eth10"); "=" asks for
    # this exact name. gloo takes the name as is.
    chosen = {GLOO_VAR: name, NCCL_VAR: f"={name}"}
    for var in unset:
        env[var] = chosen[var]
    return {var: chosen[var] for var in unset}
