"""The socket conventions every ZeroMQ end shares: the ``tcp://host:port`` endpoint (an IPv6
host in brackets, ``tcp://[::1]:port``) and the millisecond timeouts that bound each wait.

Standard library only: the transport (``cluster/``) and the workers may not import each other,
so both take the format from here and it cannot drift between the two ends.
"""

from __future__ import annotations

import math
import time

__all__ = ["is_ipv6", "ms_left", "parse_tcp_endpoint", "tcp_endpoint"]


def is_ipv6(host: str) -> bool:
    """An IPv6 address (a ZeroMQ socket needs ``IPV6`` set to bind or connect to one)."""
    return ":" in host


def tcp_endpoint(host: str, port: int = 0) -> str:
    """``tcp://host:port``, brackets around an IPv6 host; port 0 lets the OS pick at bind
    (read the real one back from the socket's ``LAST_ENDPOINT``)."""
    return f"tcp://[{host}]:{port}" if is_ipv6(host) else f"tcp://{host}:{port}"


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` or ``tcp://[v6]:port`` -> ``(host, port)``, the host unbracketed.

    Raises ``ValueError`` on anything else."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if rest == endpoint or not sep or not host:
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif is_ipv6(host):
        raise ValueError(f"an IPv6 host needs brackets: {endpoint!r}")
    return host, int(port)


def ms_left(deadline: float) -> int:
    """Milliseconds until the ``time.monotonic()`` deadline, rounded up so that a wait never
    ends before it; 0 once it has passed."""
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))
