"""The gloo weight-transfer backend (titan_learner.vllm) on several inference workers.

The trainer engine and two worker engines (tensor-parallel ranks of one engine) join one real
gloo group in this process; a client runs each control call on every worker at once, as vLLM's
`collective_rpc` does. What stands in for vLLM is only the served model: a transformers model
that the worker's swap copies into (vLLM's in-place reload is exercised against a real engine
in tests/integration/test_vllm_engine.py, which has one worker: a CPU engine cannot have two).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from tests.support.models import batches, hf_model, learner_logits, state, tiny_config, tokens
from tests.support.vllm import needs_vllm, tamper_in_transit
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.matching import WeightsError, copy_into_module

pytestmark = needs_vllm

F32 = torch.float32
WORKERS = 2


@pytest.fixture(scope="module")
def trained():
    learner = LocalLearner(tiny_config("qwen3"))  # tied embeddings: the alias travels too
    learner.update(batches(1)[0])
    return learner


def worker_engine(learner, rank: int):
    """Our worker engine as vLLM builds it, over a transformers model standing in for vLLM's."""
    from titan_learner.vllm.gloo_engine import GlooWeightTransferEngine

    class IntoHFModel(GlooWeightTransferEngine):
        def _swap(self, staged):
            copy_into_module(self.model, staged, rejected="swap")

    parallel = SimpleNamespace(rank=rank, world_size=WORKERS, data_parallel_index=0)
    vllm_config = SimpleNamespace(
        parallel_config=parallel, model_config=SimpleNamespace(hf_config=hf_config(learner.spec))
    )
    return IntoHFModel(None, vllm_config, torch.device("cpu"), hf_model(learner, seed=rank))


class EveryWorker:
    """vLLM's four control calls, each run on every worker at once (they meet in collectives)."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.versions: list[str | None] = []

    def _on_all(self, call) -> None:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            for done in [pool.submit(call, w) for w in self.workers]:
                done.result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._on_all(lambda w: w.init_transfer_engine(w.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self._on_all(lambda w: w.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        self._on_all(lambda w: w.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._on_all(lambda w: w.finish_weight_update())
        self.versions.append(weight_version)


@pytest.fixture
def transfer(trained):
    from titan_learner.vllm.transfer import EngineWeightTransfer

    client = EveryWorker([worker_engine(trained, rank) for rank in range(WORKERS)])
    sender = EngineWeightTransfer(client, "gloo", workers=WORKERS)
    yield sender, client
    sender.close()


def served(client) -> list[torch.nn.Module]:
    return [w.model for w in client.workers]


def test_every_worker_serves_the_learners_weights_and_version(trained, transfer):
    sender, client = transfer
    sender.send(list(trained.get_weights(dtype=F32).items()), version=7)
    assert client.versions == ["7"]
    x = tokens()
    for model in served(client):
        with torch.no_grad():
            torch.testing.assert_close(
                model(x).logits, learner_logits(trained, x), atol=1e-5, rtol=0
            )
    assert all(w._staged is None for w in client.workers), "staged copies are dropped"


def test_bytes_altered_in_transit_are_refused_by_every_worker(trained, transfer, monkeypatch):
    """The manifest (on the control route) vouches for other bytes than the broadcast carried."""
    sender, client = transfer
    before = [state(m) for m in served(client)]
    tamper_in_transit(monkeypatch, sender.engine)
    with pytest.raises(WeightsError, match="refused export v1, it serves its previous weights"):
        sender.send(list(trained.get_weights(dtype=F32).items()), version=1)
    for model, previous in zip(served(client), before, strict=True):
        assert all(torch.equal(t, previous[n]) for n, t in model.state_dict().items())
    assert client.versions == [] and all(w._staged is None for w in client.workers)


def test_a_manifest_that_does_not_match_what_arrived_is_refused(trained, transfer):
    """Driven by hand: announce v3, broadcast it, then vouch for v4 or for other names."""
    from titan_learner.dtypes import dtype_name
    from titan_learner.vllm.update_wire import ManifestedUpdateInfo
    from titan_learner.weights.export import checksum_of

    sender, client = transfer
    named = list(trained.get_weights(dtype=F32).items())
    announce = ManifestedUpdateInfo(
        version=3,
        names=[n for n, _ in named],
        dtype_names=[dtype_name(t.dtype) for _, t in named],
        shapes=[list(t.shape) for _, t in named],
    )
    checksum = checksum_of(named)

    def received() -> None:
        client.start_weight_update()
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(client.update_weights, asdict(announce))
            for _, tensor in named:
                sender.engine.group.broadcast(tensor.contiguous(), 0).wait()
            receiving.result()

    received()
    stale = {**asdict(announce), "version": 4, "checksum": checksum}
    with pytest.raises(WeightsError, match="manifest of v4 but this worker received v3"):
        client.update_weights(stale)
    with pytest.raises(WeightsError, match="finish without an accepted manifest"):
        client.finish_weight_update("3")
    received()
    swapped = [named[1][0], named[0][0], *announce.names[2:]]  # embed_tokens <-> lm_head
    with pytest.raises(WeightsError, match="export v3: names arrived out of the manifest's order"):
        client.update_weights({**asdict(announce), "names": swapped, "checksum": checksum})
    with pytest.raises(ValueError, match="2 names, 3 dtype names and 3 shapes"):
        client.update_weights(
            {"version": 3, "names": ["a", "b"], "dtype_names": ["float32"] * 3, "shapes": [[1]] * 3}
        )


def test_worker_ranks_follow_the_trainer_across_data_parallel_replicas():
    from titan_learner.vllm.gloo_engine import worker_rank
    from titan_learner.vllm.gloo_wire import GlooInitInfo

    info = GlooInitInfo(master_address="127.0.0.1", master_port=1, world_size=9, secret="s")
    ranks = [
        worker_rank(info, SimpleNamespace(data_parallel_index=d, world_size=4, rank=r))
        for d in range(2)
        for r in range(4)
    ]
    assert ranks == list(range(1, 9))


def test_a_peer_without_the_rendezvous_secret_cannot_join_the_broadcast(trained):
    """An intruder reaches the trainer's store port (it learned the address, not the secret
    that travelled on the guarded control route) and asks for a worker's rank: it finds no
    group under its prefix and times out, while the real workers join and receive."""
    from titan_learner.vllm.gloo_engine import join_group
    from titan_learner.vllm.transfer import EngineWeightTransfer

    attempts: list[BaseException | None] = []

    class WithIntruder(EveryWorker):
        def init_weight_transfer_engine(self, init_info: dict) -> None:
            def intrude() -> None:
                try:
                    join_group(
                        init_info["master_address"],
                        init_info["master_port"],
                        "not-the-secret",
                        1,
                        init_info["world_size"],
                        3.0,
                    )
                    attempts.append(None)
                except Exception as err:
                    attempts.append(err)

            with ThreadPoolExecutor(1) as pool:
                intruding = pool.submit(intrude)
                super().init_weight_transfer_engine(init_info)
                intruding.result()

    client = WithIntruder([worker_engine(trained, rank) for rank in range(WORKERS)])
    sender = EngineWeightTransfer(client, "gloo", workers=WORKERS)
    try:
        assert len(attempts) == 1 and attempts[0] is not None, "the intruder joined a group"
        sender.send(list(trained.get_weights(dtype=F32).items()), version=3)
        assert client.versions == ["3"]
        x = tokens()
        with torch.no_grad():
            for model in served(client):
                torch.testing.assert_close(
                    model(x).logits, learner_logits(trained, x), atol=1e-5, rtol=0
                )
    finally:
        sender.close()
