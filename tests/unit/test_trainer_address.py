"""Where a rollout server reaches the trainer for a weight broadcast's rendezvous
(`titan_learner.vllm.transfer.address_toward`): the trainer's own address on its route to the
server, never a loopback address for a server on another machine (which would connect to
itself)."""

from __future__ import annotations

import ipaddress

import pytest

from tests.support.servers import off_loopback_address
from titan_learner.vllm.transfer import address_toward


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/v1"])
def test_a_server_on_this_machine_reaches_it_over_loopback(url):
    assert ipaddress.ip_address(address_toward(url)).is_loopback


def test_a_server_on_another_address_gets_this_machines_address_on_that_route():
    own = off_loopback_address()
    if own is None:
        pytest.skip("this machine has no route off loopback")
    assert address_toward(f"http://{own}:8000") == own
    assert address_toward("http://192.0.2.77:8000") == own  # a host elsewhere on that route
