"""The trainer side of a checked update (`vllm.checked_round`, shared by the gloo and nccl
backends): a source whose tensors disagree with its metadata ends the round as one
WeightsError carrying vLLM's own message, with no manifest sent and nothing finished, so the
workers never swap anything in."""

from __future__ import annotations

import pytest
import torch

from tests.support.vllm import needs_vllm
from titan_learner.weights.matching import WeightsError

pytestmark = needs_vllm


class RecordingClient:
    """vLLM's four control calls, recorded (the workers' side is not under test here)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("manifest" if update_info["checksum"] else "announce")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish v{weight_version}")


def source_of(named: list[tuple[str, torch.Tensor]], version: int):
    from titan_learner.vllm.sources import NamedTensorSource

    source = NamedTensorSource()
    source.fill(named, version=version)
    return source


def broadcast_declaring(meta_count: int):
    """A data channel that checks the source as vLLM's trainer engines do, against the first
    `meta_count` entries of its metadata."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from titan_learner.weights.export import checksum_of

    def broadcast(source, meta) -> str:
        checked = NCCLTrainerWeightTransferEngine._checked_iter(source, meta[:meta_count])
        return checksum_of(list(checked))

    return broadcast


NAMED = [("w", torch.randn(3, 2)), ("b", torch.randn(5)), ("v", torch.randn(2, 2))]


def test_a_whole_round_announces_broadcasts_sends_the_manifest_and_finishes_the_version():
    from titan_learner.vllm.checked_round import send_checked

    client = RecordingClient()
    send_checked(client, source_of(NAMED, 7), broadcast_declaring(len(NAMED)), True, channel="c")
    assert client.calls == ["start", "announce", "manifest", "finish v7"]


def test_a_source_that_disagrees_with_its_metadata_is_one_weights_error_and_no_finish():
    from titan_learner.vllm.checked_round import send_checked

    client = RecordingClient()
    with pytest.raises(WeightsError) as raised:
        send_checked(
            client, source_of(NAMED, 7), broadcast_declaring(2), is_sender=True, channel="c"
        )
    assert str(raised.value) == (
        "WeightSource yielded more parameters than metadata() declared (2); first extra is 'v'."
    )
    assert client.calls == ["start", "announce"]


class SessionKeepingEngine:
    """One engine's control calls under vLLM 0.32's worker bookkeeping
    (vllm/v1/worker/gpu_worker.py): a start is refused while a session is open; an update that
    raises ends the session; a finish that returns ends it. `refuse_manifest`: this engine's
    workers refuse the manifest, as ours do when the bytes differ from it."""

    def __init__(self, url: str, refuse_manifest: bool = False) -> None:
        self.url, self.refuse_manifest = url, refuse_manifest
        self.active = False
        self.calls: list[str] = []

    def workers(self) -> int:
        return 1

    def start_weight_update(self) -> None:
        if self.active:
            self.calls.append("start refused")
            raise RuntimeError(
                f"{self.url}: start_weight_update called while a weight update is already active"
            )
        self.active = True
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        kind = (
            "abandon"
            if update_info["abandoned"]
            else "manifest"
            if update_info["checksum"]
            else "announce"
        )
        self.calls.append(kind)
        if kind == "abandon" or (kind == "manifest" and self.refuse_manifest):
            self.active = False
            raise RuntimeError(f"{self.url}: weight update refused, nothing was swapped")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        assert self.active
        self.active = False
        self.calls.append(f"finish v{weight_version}")


def test_a_round_one_server_of_two_refuses_ends_the_others_session_so_the_next_round_runs():
    from titan_learner.vllm.checked_round import send_checked
    from titan_learner.vllm.server_group import ServerGroup

    accepting, refusing = SessionKeepingEngine("a"), SessionKeepingEngine("b", refuse_manifest=True)
    group = ServerGroup([accepting, refusing])
    broadcast = broadcast_declaring(len(NAMED))
    with pytest.raises(WeightsError, match="refused export v7"):
        send_checked(group, source_of(NAMED, 7), broadcast, is_sender=True, channel="c")
    assert accepting.calls == ["start", "announce", "manifest", "abandon"]
    assert refusing.calls == ["start", "announce", "manifest"]  # vLLM ended its session
    assert not accepting.active and not refusing.active
    refusing.refuse_manifest = False
    send_checked(group, source_of(NAMED, 8), broadcast, is_sender=True, channel="c")
    assert [e.calls[-1] for e in (accepting, refusing)] == ["finish v8", "finish v8"]


def test_a_session_left_open_is_abandoned_and_the_round_runs_with_one_warning():
    from titan_learner.vllm.checked_round import send_checked
    from titan_learner.vllm.server_group import ServerGroup

    fresh, stale = SessionKeepingEngine("a"), SessionKeepingEngine("b")
    stale.active = True  # a trainer stopped between its start and finish
    with pytest.warns(UserWarning) as said:
        send_checked(
            ServerGroup([fresh, stale]),
            source_of(NAMED, 3),
            broadcast_declaring(3),
            True,
            channel="c",
        )
    assert [str(w.message) for w in said] == [
        "a weight-update session was left open (a trainer stopped between start and finish), "
        "abandoned: b: start_weight_update called while a weight update is already active"
    ]
    assert stale.calls == ["start refused", "abandon", "start", "announce", "manifest", "finish v3"]
    assert fresh.calls == ["start", "announce", "manifest", "finish v3"]


def test_a_start_still_refused_after_abandoning_is_raised_and_no_session_stays_open():
    from titan_learner.vllm.checked_round import send_checked
    from titan_learner.vllm.server_group import ServerGroup

    class Down(SessionKeepingEngine):
        def start_weight_update(self) -> None:
            raise ConnectionError(f"{self.url} is unreachable")

        def update_weights(self, update_info: dict) -> None:
            raise ConnectionError(f"{self.url} is unreachable")

    up, down = SessionKeepingEngine("a"), Down("b")
    with pytest.raises(ConnectionError, match="b is unreachable"):
        send_checked(
            ServerGroup([up, down]), source_of(NAMED, 4), broadcast_declaring(3), True, channel="c"
        )
    assert up.calls == ["start", "abandon"] and not up.active
