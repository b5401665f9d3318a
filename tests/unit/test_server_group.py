"""Several rollout servers as one weight-transfer client (`vllm.server_group`), against local
HTTP servers that answer as vLLM's routes do: a server that refuses to join the trainer's
group is raised at once, while another still waits inside the group's init."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from tests.support.servers import local_http
from titan_learner.vllm.server_client import ServerClient, ServerError
from titan_learner.vllm.server_group import ServerGroup


def routes(on_init, released: threading.Event) -> type[BaseHTTPRequestHandler]:
    """One worker (/get_world_size); POST /init_weight_transfer_engine answers what `on_init`
    returns, (status, body), or waits until `released` (a worker inside the group's init)."""

    class Routes(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(200, {"world_size": 1})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer = on_init()
            if answer is None:
                released.wait()
                answer = (200, {"message": "Weight transfer initialized"})
            self._answer(*answer)

        def _answer(self, status: int, body: dict) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args) -> None:
            pass

    return Routes


def test_a_server_that_refuses_the_init_is_raised_while_another_waits_in_the_group():
    released = threading.Event()
    refusal = (500, {"error": "unknown weight transfer backend"})
    with (
        local_http(routes(lambda: None, released)) as waiting,
        local_http(routes(lambda: refusal, released)) as refusing,
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
