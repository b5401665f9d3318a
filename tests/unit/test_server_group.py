"""Several rollout servers as one weight-transfer client (`vllm.server_group`), against local
HTTP servers that answer as vLLM's routes do: a server that refuses to join the trainer's
group is raised at once, while another still waits inside the group's init; a prefix cache
that stays held after an update (vLLM's `{"success": false}`) is one line, on a server and on an
in-process engine."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from tests.support.servers import QuietHandler, control_routes, local_http
from titan_learner.vllm.server_client import ServerClient, ServerError
from titan_learner.vllm.server_group import ServerGroup
from titan_learner.vllm.transfer import OfflineClient

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


def prefix_cache(refusals: int) -> tuple[type, list[str]]:
    """A server whose POST /reset_prefix_cache answers vLLM's `{"success": false}` (blocks
    still held) `refusals` times, then `{"success": true}`; the routes it was asked, in order."""
    asked: list[str] = []

    class Cache(QuietHandler):
        def do_POST(self) -> None:
            asked.append(self.path)
            body = json.dumps({"success": len(asked) > refusals}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Cache, asked


def test_a_prefix_cache_reset_refused_a_moment_is_tried_again():
    handler, asked = prefix_cache(refusals=2)
    with local_http(handler) as url:
        ServerClient(url, token="s3cret").reset_prefix_cache()
    assert asked == ["/reset_prefix_cache"] * 3


def test_a_prefix_cache_that_stays_held_after_an_update_is_one_line():
    """vLLM refuses the reset while blocks are held, and answers 200 all the same: taken as
    done, the next prompts would reuse KV computed with the previous weights."""
    handler, asked = prefix_cache(refusals=100)
    with local_http(handler) as url, pytest.raises(ServerError) as info:
        ServerClient(url, token="s3cret").reset_prefix_cache()
    assert len(asked) == 5
    assert str(info.value) == (
        f"rollout server {url} refused to reset its prefix cache after a weight update (5 "
        "tries, 0.2 s apart: blocks still held, by requests the job did not send, as it leaves "
        "none in flight during a push); its cached KV would be of the previous weights: keep "
        "other clients off a run's servers"
    )


def test_an_in_process_engine_that_keeps_its_prefix_cache_fails_the_update():
    """The same refusal from a vllm.LLM (`reset_prefix_cache()` returns False), whose engine
    runs in this process here (no engine process to watch)."""
    finished: list[str | None] = []
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace()),
        finish_weight_update=finished.append,
        reset_prefix_cache=lambda: False,
    )
    with pytest.raises(RuntimeError) as info:
        OfflineClient(llm).finish_weight_update("3")
    assert finished == ["3"]
    assert str(info.value) == (
        "the vLLM engine refused to reset its prefix cache after the weight update (blocks "
        "still held by requests in flight, which the job never leaves there during a push): "
        "its cached KV would be of the previous weights"
    )
