"""Several rollout servers as one weight-transfer client (`vllm.server_group`), against local
HTTP servers that answer as vLLM's routes do: a server that refuses to join the trainer's
group is raised at once, while another still waits inside the group's init."""

from __future__ import annotations

import threading

import pytest

from tests.support.servers import control_routes, local_http
from titan_learner.vllm.server_client import ServerClient, ServerError
from titan_learner.vllm.server_group import ServerGroup

INIT = "/init_weight_transfer_engine"


def test_a_server_that_refuses_the_init_is_raised_while_another_waits_in_the_group():
    released = threading.Event()
    refusal = (500, {"error": "unknown weight transfer backend"})
    with (
        local_http(control_routes(INIT, lambda: None, released)) as waiting,
        local_http(control_routes(INIT, lambda: refusal, released)) as refusing,
    ):
        try:
            group = ServerGroup(
                [ServerClient(url, token="t", timeout_s=30) for url in (waiting, refusing)]
            )
            with pytest.raises(ServerError) as info:
                group.init_weight_transfer_engine({"backend": "gloo"})
            assert not released.is_set(), "raised while the other server still waited"
        finally:
            released.set()  # the waiting server's answer, so that it can stop
    assert str(info.value) == (
        f"rollout server {refusing} answered POST /init_weight_transfer_engine with 500: "
        '{"error": "unknown weight transfer backend"}'
    )
