"""A weight send that cannot end once the engines' side failed (`vllm.stuck_send`).

The send that cannot end is an NCCL collective whose peers are gone; no machine here has NCCL
on two devices, so a send here is a thread waiting on an event that nothing sets, which is how
such a collective behaves (it never returns, and nothing in Python can interrupt it). What is
real: the threads, the control calls over HTTP to local servers that refuse or hold their
answer, vLLM's own m2n `send_weights` (its update call on vLLM's executor beside the reshards),
and the stop itself, which ends a process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from tests.support.servers import control_routes, local_http
from titan_learner.vllm.stuck_send import SendGuard, StuckSendError

GRACE_S = 0.3
STOPPED_WITHIN_S = 30  # generous: a 2-core machine under a test run


def failed(err: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(err)
    return future


class Stops:
    """Records the stop; it also releases the send, as exiting the process would."""

    def __init__(self, send_waits: threading.Event) -> None:
        self.errors: list[StuckSendError] = []
        self.stopped = threading.Event()
        self.send_waits = send_waits

    def __call__(self, err: StuckSendError) -> None:
        self.errors.append(err)
        self.stopped.set()
        self.send_waits.set()


def test_a_send_still_running_after_the_engines_failed_stops_the_job_with_their_error():
    never = threading.Event()
    stops = Stops(never)
    with SendGuard("the trainer's nccl broadcast", grace_s=GRACE_S, stop=stops) as guard:
        guard.control_done(failed(RuntimeError("rollout server http://a:1 is unreachable")))
        started = time.monotonic()
        never.wait(STOPPED_WITHIN_S)  # the NCCL broadcast whose peer is gone
    assert time.monotonic() - started >= GRACE_S
    assert [str(e) for e in stops.errors] == [
        "rollout server http://a:1 is unreachable; the trainer's nccl broadcast waits for it "
        "and cannot end (no timeout), so the job stops here, its last checkpoint unchanged: "
        "restart that server (or fix what it refused), then run the same command with --resume"
    ]


def test_a_send_that_ends_within_the_grace_raises_its_own_error_and_nothing_is_stopped():
    stops = Stops(threading.Event())
    with (
        pytest.raises(ConnectionResetError),  # gloo notices a dead peer and raises
        SendGuard("the trainer's gloo broadcast", grace_s=GRACE_S, stop=stops) as guard,
    ):
        guard.control_failed(RuntimeError("server gone"))
        raise ConnectionResetError("Connection reset by peer")
    assert not stops.stopped.wait(3 * GRACE_S)


@pytest.mark.parametrize("outcome", ["succeeds", "fails after the send ended"])
def test_a_control_call_that_succeeds_or_fails_after_the_send_never_stops_the_job(outcome):
    stops = Stops(threading.Event())
    with SendGuard("the trainer's gloo broadcast", grace_s=GRACE_S, stop=stops) as guard:
        done: Future = Future()
        done.add_done_callback(guard.control_done)
        if outcome == "succeeds":
            done.set_result(None)
    if outcome != "succeeds":
        done.set_exception(RuntimeError("the manifest was refused"))
    assert not stops.stopped.wait(3 * GRACE_S)


def test_the_stop_prints_the_one_error_line_and_ends_a_process_stuck_in_its_send():
    script = (
        "import threading\n"
        "from titan_learner.vllm.stuck_send import SendGuard\n"
        "with SendGuard('the trainer\\'s nccl broadcast', grace_s=0.2) as guard:\n"
        "    guard.control_failed(RuntimeError('rollout server http://b:2 answered 500'))\n"
        "    threading.Event().wait()  # a send that never ends\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": root, "WORLD_SIZE": "1"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: rollout server http://b:2 answered 500; the trainer's nccl broadcast waits for "
        "it and cannot end (no timeout), so the job stops here, its last checkpoint unchanged: "
        "restart that server (or fix what it refused), then run the same command with --resume\n"
    )


@pytest.fixture
def stuck_sends(monkeypatch):
    """The guard's stop recorded, after GRACE_S; `.send_waits` is the send that never ends."""
    from titan_learner.vllm import stuck_send

    never = threading.Event()
    stops = Stops(never)
    monkeypatch.setattr(stuck_send, "GRACE_S", GRACE_S)
    monkeypatch.setattr(stuck_send, "stop_job", stops)
    yield stops
    never.set()


UPDATE = "/update_weights"
REFUSAL = (500, {"error": "out of host memory for the update"})


def refused_while_receiving() -> tuple[int, dict]:
    """A refusal that comes once the trainer's send has begun (workers that fail while they
    receive), so the send is what waits for it."""
    time.sleep(0.5)
    return REFUSAL


def test_one_server_refusing_the_announce_stops_a_broadcast_the_other_server_waits_in(
    stuck_sends,
):
    """Two servers in one broadcast: one refuses the announce before its workers join, the
    other's workers wait inside the broadcast for peers that will not come (their answer never
    comes either). The checked round (gloo, nccl) stops on the refusal."""
    pytest.importorskip("vllm")
    from titan_learner.vllm.checked_round import send_checked
    from titan_learner.vllm.server_client import ServerClient, ServerError
    from titan_learner.vllm.server_group import ServerGroup
    from titan_learner.vllm.sources import NamedTensorSource

    def broadcast(source, meta) -> str:
        if not stuck_sends.send_waits.wait(STOPPED_WITHIN_S):
            released.set()  # not stopped: the test fails below, and every server answers
        return "never checked"

    source = NamedTensorSource()
    source.fill([("w", torch.ones(2, 3)), ("b", torch.zeros(3))], version=5)
    released = threading.Event()
    with (
        local_http(control_routes(UPDATE, lambda: None, released)) as waiting,
        local_http(control_routes(UPDATE, refused_while_receiving, released)) as refusing,
    ):
        try:
            servers = [ServerClient(url, token="t", timeout_s=60) for url in (waiting, refusing)]
            with pytest.raises(ServerError, match="answered POST /update_weights with 500"):
                send_checked(
                    ServerGroup(servers), source, broadcast, True, channel="nccl broadcast"
                )
            assert not released.is_set(), "the waiting server's workers were still inside"
        finally:
            released.set()
    assert [str(e) for e in stuck_sends.errors] == [
        f"rollout server {refusing} answered POST /update_weights with 500: "
        '{"error": "out of host memory for the update"}; the trainer\'s nccl broadcast waits '
        "for it and cannot end (no timeout), so the job stops here, its last checkpoint "
        "unchanged: restart that server (or fix what it refused), then run the same command "
        "with --resume"
    ]


def test_a_server_refusing_its_m2n_update_stops_the_reshards_vllm_runs_beside_it(stuck_sends):
    """vLLM's own m2n `send_weights`: start, the update call on its executor, every rank's
    reshards (here the send that never ends), then the update's result."""
    pytest.importorskip("vllm")
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerWeightTransferEngine

    from titan_learner.vllm.m2n_trainer import M2NTransfer, VersionedFinish
    from titan_learner.vllm.server_client import ServerClient

    with local_http(control_routes(UPDATE, lambda: REFUSAL, threading.Event())) as refusing:
        client = VersionedFinish(ServerClient(refusing, token="t", timeout_s=60))
        engine = object.__new__(M2NTrainerWeightTransferEngine)  # init would join NCCL
        engine.client, engine.is_controller, engine._metas = client, True, []
        engine._handle, engine.group = object(), object()
        engine._executor = ThreadPoolExecutor(max_workers=1)
        engine._send = lambda: stuck_sends.send_waits.wait(STOPPED_WITHIN_S)
        transfer = object.__new__(M2NTransfer)  # init would join NCCL
        transfer.clients, transfer.engines = [client], [engine]
        with pytest.raises(Exception, match="answered POST /update_weights with 500"):
            transfer.send(version=9)
    assert [str(e).split("; ", 1)[1] for e in stuck_sends.errors] == [
        "the trainer's nccl_m2n reshard waits for it and cannot end (no timeout), so the job "
        "stops here, its last checkpoint unchanged: restart that server (or fix what it "
        "refused), then run the same command with --resume"
    ]
