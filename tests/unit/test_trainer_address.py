"""Where a rollout server reaches the trainer for a weight broadcast's rendezvous
(`titan_learner.vllm.transfer.address_toward`): the trainer's own address on its route to the
server, never a loopback address for a server on another machine (which would connect to
itself)."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from titan_learner.vllm.transfer import address_toward


def default_route_address() -> str | None:
    """This machine's source address toward TEST-NET-1 (RFC 5737; a UDP connect sends
    nothing): its non-loopback address, or None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        return probe.getsockname()[0]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/v1"])
def test_a_server_on_this_machine_reaches_it_over_loopback(url):
    assert ipaddress.ip_address(address_toward(url)).is_loopback


def test_a_server_on_another_address_gets_this_machines_address_on_that_route():
    own = default_route_address()
    if own is None or ipaddress.ip_address(own).is_loopback:
        pytest.skip("this machine has no route off loopback")
    assert address_toward(f"http://{own}:8000") == own
    assert address_toward("http://192.0.2.77:8000") == own  # a host elsewhere on that route
