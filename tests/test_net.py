"""The endpoint format both ZeroMQ ends share: one formatter, one parser, IPv6 in brackets."""

from __future__ import annotations

import time

import pytest

from pagedserve.net import is_ipv6, ms_left, parse_tcp_endpoint, tcp_endpoint


@pytest.mark.parametrize(
    ("host", "port", "endpoint"),
    [("127.0.0.1", 0, "tcp://127.0.0.1:0"), ("10.0.0.7", 5555, "tcp://10.0.0.7:5555"),
     ("::1", 41000, "tcp://[::1]:41000"), ("fe80::1%eth0", 7, "tcp://[fe80::1%eth0]:7")],
)
def test_format_and_parse_are_inverse(host: str, port: int, endpoint: str) -> None:
    assert tcp_endpoint(host, port) == endpoint
    assert parse_tcp_endpoint(endpoint) == (host, port)
    assert is_ipv6(host) == ("[" in endpoint)


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:5", "ipc:///tmp/x", "tcp://127.0.0.1", "tcp://:5", "tcp://::1:5",
            "tcp://host:port"],
)
def test_parse_refuses_what_is_not_a_tcp_endpoint(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_tcp_endpoint(bad)


def test_ms_left_rounds_up_and_stops_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "monotonic", lambda: 100.0)
    assert ms_left(99.0) == 0 and ms_left(100.0) == 0
    assert ms_left(100.0001) == 1  # a wait never ends before its deadline
    assert ms_left(102.0) == 2000
