"""The choice of the interface a rank's collectives bind to, without namespaces: this host's
real interfaces, and made-up tables for the cases a host here does not have."""

from __future__ import annotations

import os
import pickle

import pytest
import torch.distributed as dist

from pagedserve.parallel.netif import (
    NoUsableInterfaceError,
    bind_collectives,
    interface_addresses,
    interface_for_address,
)

TABLE = {
    "lo": ["127.0.0.1", "::1"],
    "eth1": ["10.1.0.5", "fe80::1%eth1"],
    "eth10": ["192.168.7.2", "192.168.7.3"],  # an alias: a second address on one interface
    "ib0": ["fd00::17"],
}


def test_this_hosts_interfaces_include_loopback():
    found = interface_addresses()
    assert interface_for_address("127.0.0.1", found) is not None
    assert all(isinstance(ip, str) for ips in found.values() for ip in ips)


@pytest.mark.parametrize(
    ("address", "name"),
    [("10.1.0.5", "eth1"), ("192.168.7.3", "eth10"), ("fd00::17", "ib0"), ("[fd00::17]", "ib0"),
     ("fd00:0::17", "ib0"), ("127.0.0.1", "lo"), ("10.1.0.6", None)],
)
def test_interface_for_address(address, name):
    assert interface_for_address(address, TABLE) == name


def test_bind_sets_both_variables_to_the_node_ip_interface():
    env: dict[str, str] = {}
    chosen = bind_collectives("192.168.7.2", node="n1", env=env, list_interfaces=lambda: TABLE)
    # NCCL matches names by prefix ("eth1" would also take "eth10"): "=" asks for this one.
    assert env == chosen == {"GLOO_SOCKET_IFNAME": "eth10", "NCCL_SOCKET_IFNAME": "=eth10"}


def test_bind_keeps_what_the_user_set():
    env = {"GLOO_SOCKET_IFNAME": "bond0"}
    chosen = bind_collectives("10.1.0.5", node="n1", env=env, list_interfaces=lambda: TABLE)
    assert chosen == {"NCCL_SOCKET_IFNAME": "=eth1"}
    assert env["GLOO_SOCKET_IFNAME"] == "bond0"

    both = {"GLOO_SOCKET_IFNAME": "bond0", "NCCL_SOCKET_IFNAME": "bond0"}

    def never() -> dict[str, list[str]]:
        raise AssertionError("interfaces listed although the user chose both")

    assert bind_collectives("10.9.9.9", node="n1", env=both, list_interfaces=never) == {}


def test_no_interface_carries_the_address_is_a_clear_typed_error():
    env: dict[str, str] = {}
    with pytest.raises(NoUsableInterfaceError) as info:
        bind_collectives("10.1.0.99", node="node-abc (10.1.0.99)", env=env,
                         list_interfaces=lambda: TABLE)
    err = info.value
    text = str(err)
    assert "node-abc (10.1.0.99)" in text and "10.1.0.99" in text
    assert "GLOO_SOCKET_IFNAME" in text and "NCCL_SOCKET_IFNAME" in text
    assert "eth1: 10.1.0.5" in text  # what the node does have
    assert env == {}
    # Raised inside a Ray actor: it must survive the trip back to the driver.
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, NoUsableInterfaceError)
    assert (back.node, back.address, str(back)) == (err.node, err.address, text)


def test_gloo_group_over_the_chosen_loopback_interface(monkeypatch):
    # The variable really steers gloo: a one-rank group built on the interface chosen for
    # 127.0.0.1 (a two-rank group across hosts runs in tests/multihost).
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    chosen = bind_collectives("127.0.0.1", node="here")
    assert os.environ["GLOO_SOCKET_IFNAME"] == chosen["GLOO_SOCKET_IFNAME"]
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    pg = dist.ProcessGroupGloo(store, 0, 1)
    assert pg.size() == 1
