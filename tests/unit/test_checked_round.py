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
    send_checked(client, source_of(NAMED, 7), broadcast_declaring(len(NAMED)), is_sender=True)
    assert client.calls == ["start", "announce", "manifest", "finish v7"]


def test_a_source_that_disagrees_with_its_metadata_is_one_weights_error_and_no_finish():
    from titan_learner.vllm.checked_round import send_checked

    client = RecordingClient()
    with pytest.raises(WeightsError) as raised:
        send_checked(client, source_of(NAMED, 7), broadcast_declaring(2), is_sender=True)
    assert str(raised.value) == (
        "WeightSource yielded more parameters than metadata() declared (2); first extra is 'v'."
    )
    assert client.calls == ["start", "announce"]
