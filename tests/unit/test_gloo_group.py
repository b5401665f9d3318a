"""The gloo backend's group is reachable from another machine: the trainer's side
(`gloo_trainer.open_group`) and a worker's (`gloo_engine.join_group`) make their connections on
the address they reach each other by, not on the one this machine's hostname resolves to.
Where the hostname resolves to loopback (as here and in most containers: `127.0.0.1 vm`),
torch's default gloo device listened on 127.0.0.1, and a server on another machine, told to
connect there, connected to itself. One machine cannot host that other machine, so the tests
check where the groups' sockets are, on the machine's own off-loopback address, with a real
broadcast through them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.support.servers import off_loopback_address
from tests.support.vllm import needs_vllm

pytestmark = needs_vllm


def listening() -> set[tuple[str, int]]:
    import psutil

    return {
        (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }


class JoiningWorker:
    """The control route's part in a test: the trainer's init request makes a worker join
    the group (`join_group`, as a server's worker does) and receive one broadcast."""

    def __init__(self) -> None:
        self.received = torch.zeros(5)
        self.thread: threading.Thread | None = None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from titan_learner.vllm.gloo_engine import join_group

        def join() -> None:
            group = join_group(
                init_info["master_address"],
                init_info["master_port"],
                init_info["secret"],
                1,
                init_info["world_size"],
                init_info["timeout_s"],
            )
            group.broadcast(self.received, 0).wait()

        self.thread = threading.Thread(target=join)
        self.thread.start()


def group_through(address: str) -> tuple[set[tuple[str, int]], JoiningWorker]:
    """A trainer's group with one worker, both reached at `address`: the sockets they
    opened to listen on, and the worker once it received the trainer's broadcast."""
    from titan_learner.vllm.gloo_trainer import GlooTrainerInitInfo, open_group

    before = listening()
    worker = JoiningWorker()
    info = GlooTrainerInitInfo(rank=0, world_size=2, master_address=address, timeout_s=30)
    group = open_group(info, worker)
    opened = listening() - before
    group.broadcast(torch.arange(5.0), 0).wait()
    assert worker.thread is not None
    worker.thread.join(30)
    return opened, worker


def test_a_group_toward_another_machine_listens_on_the_address_that_machine_reaches():
    own = off_loopback_address()
    if own is None:
        pytest.skip("this machine has no address off loopback")
    opened, worker = group_through(own)
    assert torch.equal(worker.received, torch.arange(5.0))
    # the rendezvous store listens on every interface; each gloo side on `own` alone
    gloo = {(ip, port) for ip, port in opened if ip not in ("::", "0.0.0.0")}
    assert len(gloo) == 2, opened
    assert {ip for ip, _ in gloo} == {own}


def test_a_group_toward_this_machine_stays_on_loopback():
    opened, worker = group_through("127.0.0.1")
    assert torch.equal(worker.received, torch.arange(5.0))
    gloo = {(ip, port) for ip, port in opened if ip not in ("::", "0.0.0.0")}
    assert {ip for ip, _ in gloo} == {"127.0.0.1"}, opened
