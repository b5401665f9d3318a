"""What each rank of a checkpoint test world runs (spawned processes import it by name).

Every check of one world size shares one world: `world_of_4` (a save at dp_shard=4 loaded at
dp_shard=2 x tp=2) and `world_of_2` (same-layout resume through an asynchronous save, a
corrupted shard, a rank that never joins a save). `killed_while_saving` is the body of a
process the test kills with SIGKILL in the middle of a save.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from tests.support.models import batches, tiny_config
from titan_learner import checkpoint
from titan_learner.checkpoint import save_load
from titan_learner.learner.contract import Learner
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.titan import TitanLearner

SAVE_AT = 2
STEPS = 4
SKIP_TIMEOUT_S = 5.0
FULL_AC_FSDP = {"parallelism": {"dp_shard": 2}, "activation_checkpoint": {"mode": "full"}}


def flip_one_bit(path: Path, chosen: Callable[[Any, Any], bool]) -> tuple[str, Any]:
    """Flip one bit in the middle of the first record `chosen(index, storage_info)` picks;
    its key and storage info. A raw tensor record is the tensor's bytes, so it still decodes,
    to a different value: only its checksum can tell."""
    from titan_learner.checkpoint.safe_read import read_metadata

    storage = read_metadata(path).storage_data.items()
    index, info = next((i, v) for i, v in storage if chosen(i, v))
    file = path / info.relative_path
    data = bytearray(file.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    file.write_bytes(bytes(data))
    return index.fqn, info


def train(learner: Learner, data: list[TensorDictBase]) -> list[dict[str, float]]:
    """One update per global batch (each rank its slice); metrics as plain floats."""
    return [
        {k: float(v) for k, v in learner.update(learner.local_batch(batch)).items()}
        for batch in data
    ]


@torch.no_grad()
def full_optimizer_state(learner: Learner) -> dict[str, torch.Tensor]:
    """The optimizer's flat state with every DTensor gathered (a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in learner.optimizer.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu().clone()
    return out


def state_keys(learner: Learner) -> dict[str, list[str]]:
    """The checkpoint's model and optimizer keys: they must not depend on the layout."""
    state = learner.checkpoint()
    return {part: sorted(state[part]) for part in ("model", "optimizer")}


def snapshot(learner: Learner) -> dict[str, Any]:
    """Full weights, optimizer moments and keys (a collective; tensors kept on rank 0 only)."""
    weights = dict(learner.get_weights().items())
    moments = full_optimizer_state(learner)
    keys = state_keys(learner)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {"keys": keys}
    return {"weights": weights, "moments": moments, "keys": keys, "step": learner.step}


def assert_same_state(got: dict, want: dict) -> None:
    """The same keys, tensors bit for bit, other values equal."""
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), key
        else:
            assert got[key] == want[key], key


def assert_resumes_exactly(learner: Learner, root: Path, data: list[TensorDictBase]) -> None:
    """A fresh one-process learner loaded from `root` trains `data` to `learner`'s metrics,
    weights and optimizer moments, bit for bit (`learner` trains `data` too)."""
    expected = train(learner, data)
    resumed = LocalLearner(tiny_config())
    checkpoint.load(resumed, root)
    assert train(resumed, data) == expected
    for part in ("weights", "moments"):
        assert_same_state(snapshot(resumed)[part], snapshot(learner)[part])


# -- world of 4 ------------------------------------------------------------------------------


def world_of_4(rank: int, root: str) -> dict[str, Any]:
    """Save at dp_shard=4 after SAVE_AT steps; load at dp_shard=2 x tp=2; both take one step."""
    data = batches(SAVE_AT + 1)
    dp4 = TitanLearner.from_config(tiny_config(parallelism={"dp_shard": 4}))
    train(dp4, data[:SAVE_AT])
    path = checkpoint.save(dp4, root).wait()
    saved = snapshot(dp4)
    dp4_next = train(dp4, data[SAVE_AT:])
    fsdp_tp = TitanLearner.from_config(tiny_config(parallelism={"dp_shard": 2, "tp": 2}))
    loaded_path = checkpoint.load(fsdp_tp, root)
    loaded = snapshot(fsdp_tp)
    fsdp_tp_next = train(fsdp_tp, data[SAVE_AT:])
    return {
        "path": str(path),
        "loaded_path": str(loaded_path),
        "saved": saved,
        "loaded": loaded,
        "dp4_next": dp4_next,
        "fsdp_tp_next": fsdp_tp_next,
    }


# -- world of 2 ------------------------------------------------------------------------------


def world_of_2(rank: int, root: str) -> dict[str, Any]:
    base = Path(root)
    resume, learner = resume_after_async_save(base / "resume")
    return {
        "resume": resume,
        "corrupted": load_corrupted_shard(learner, base / "resume", base / "corrupted"),
        "skipped": rank_skips_a_save(learner, base / "skip"),  # last: it leaves rank 0's group dead
    }


def resume_after_async_save(root: Path) -> tuple[dict[str, Any], Learner]:
    """FSDP + full AC: save asynchronously at SAVE_AT while training on; resume a fresh learner."""
    config = tiny_config(**FULL_AC_FSDP)
    data = batches(STEPS)
    first = TitanLearner.from_config(config)
    train(first, data[:SAVE_AT])
    handle = checkpoint.save(first, root, asynchronous=True)
    uninterrupted = train(first, data[SAVE_AT:])  # overlaps the background write
    committed = handle.wait()
    second = TitanLearner.from_config(config)
    checkpoint.load(second, root)
    resumed = train(second, data[SAVE_AT:])
    result = {
        "committed": str(committed),
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "uninterrupted_state": snapshot(first),
        "resumed_state": snapshot(second),
    }
    return result, second


def local_tensors(learner: Learner) -> dict[str, torch.Tensor]:
    """This rank's own shards of the model and optimizer state, as plain tensors (clones)."""
    from torch.distributed.tensor import DTensor

    state = learner.checkpoint()
    return {
        f"{part}.{key}": value.to_local() if isinstance(value, DTensor) else value
        for part in ("model", "optimizer")
        for key, value in state[part].items()
        if isinstance(value, torch.Tensor)
    }


def zero_a_record_only_rank1_reads(step: Path) -> None:
    """Zeros over rank 1's shard of the embedding (same length: only a read can tell)."""
    metadata = checkpoint.read_metadata(step)
    info = next(
        info
        for index, info in metadata.storage_data.items()
        if index.fqn == "model.tok_embeddings.weight" and info.relative_path == "__1_0.distcp"
    )
    with open(step / info.relative_path, "r+b") as shard:
        shard.seek(info.offset)
        shard.write(bytes(info.length))


def load_corrupted_shard(learner: Learner, root: Path, damaged: Path) -> dict[str, Any]:
    """A record in rank 1's shard file zeroed: every rank must raise, none may hang, and no
    rank's state may change, although rank 0's own records are sound (and differ from its
    state: it trained on after the save)."""
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint.latest(root), damaged)
        zero_a_record_only_rank1_reads(damaged)
    dist.barrier()
    before = local_tensors(learner)
    try:
        checkpoint.load(learner, damaged)
        error = "no error"
    except checkpoint.CheckpointError as err:
        error = str(err)
    after = local_tensors(learner)
    unchanged = before.keys() == after.keys() and all(
        torch.equal(after[key], value) for key, value in before.items()
    )
    return {"error": error, "unchanged": unchanged}


def rank_skips_a_save(learner: Learner, root: Path) -> dict[str, Any]:
    """Both ranks save once (the group exists); then rank 1 skips a save: rank 0 must fail."""
    checkpoint.save(learner, root / "both", timeout=SKIP_TIMEOUT_S)
    outcome: dict[str, Any] = {}
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            checkpoint.save(learner, root / "alone", timeout=SKIP_TIMEOUT_S)
            outcome["error"] = None
        except checkpoint.CheckpointTimeoutError as err:
            outcome["error"] = str(err)
        outcome["seconds"] = time.monotonic() - start
    dist.barrier()  # rank 1 waits here, on the training group, for rank 0 to give up
    return outcome


# -- a process killed in the middle of a save -------------------------------------------------


def killed_while_saving(root: str, marker: str) -> None:
    """Train to step SAVE_AT + 1 and save; the commit never comes: the parent kills us then.

    By then every shard and `.metadata` sit in `step-<N>.tmp`: complete data, not committed.
    """

    def stall(*args: Any, **kwargs: Any) -> None:
        Path(marker).touch()
        time.sleep(600)

    torch.set_num_threads(1)
    learner = LocalLearner(tiny_config())
    train(learner, batches(SAVE_AT + 1))
    save_load.commit = stall  # the name save() calls to commit
    checkpoint.save(learner, root)
