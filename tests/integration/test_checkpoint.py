"""DCP checkpoints: atomic commit, bit-identical resume, resume on another layout, faults.

One spawned world of 4 runs every 4-process check and one world of 2 every 2-process check
(checkpoint_scenarios.py); the one-process checks use LocalLearner in this process, which is
also the parity reference for the sharded runs.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

from tests.support.checkpoint_scenarios import (
    SAVE_AT,
    SKIP_TIMEOUT_S,
    STEPS,
    flip_one_bit,
    killed_while_saving,
    snapshot,
    train,
    world_of_2,
    world_of_4,
)
from tests.support.models import batches, tiny_config
from tests.support.worlds import run_world
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.layout import committed_steps, latest
from titan_learner.checkpoint.save_load import load, save
from titan_learner.learner.local import LocalLearner

TOL = 1e-5
COMPARED = ("loss_objective", "loss_entropy", "grad_norm")


def assert_same_tensors(got: dict, want: dict) -> None:
    """Exactly equal: a checkpoint moves bytes, whatever the layout."""
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)


def assert_metrics_close(got: list[dict], want: list[dict], exact: bool = False) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        if exact:
            assert a == b, step
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], abs=TOL), (step, key)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The one-process run the sharded ones are compared with: STEPS updates."""
    learner = LocalLearner(tiny_config())
    return {"metrics": train(learner, batches(STEPS)), "keys": snapshot(learner)["keys"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A LocalLearner checkpoint after SAVE_AT steps, and that learner's full state."""
    root = tmp_path_factory.mktemp("saved")
    learner = LocalLearner(tiny_config())
    train(learner, batches(SAVE_AT))
    rng = torch.get_rng_state()
    path = save(learner, root).wait()
    return {"root": root, "path": path, "state": snapshot(learner), "rng": rng}


def damaged_copy(saved: dict, tmp_path: Path) -> Path:
    copy = tmp_path / "damaged"
    shutil.copytree(saved["path"], copy)
    return copy


# -- one process -----------------------------------------------------------------------------


def test_resume_continues_bit_identically(saved, reference):
    resumed = LocalLearner(tiny_config())
    torch.manual_seed(1234)
    assert load(resumed, saved["root"]) == saved["path"]
    assert (resumed.step, resumed.policy_version) == (SAVE_AT, SAVE_AT)
    assert torch.equal(torch.get_rng_state(), saved["rng"]), "the RNG state is restored"
    metrics = train(resumed, batches(STEPS)[SAVE_AT:])
    assert metrics == reference["metrics"][SAVE_AT:]
    uninterrupted = LocalLearner(tiny_config())
    train(uninterrupted, batches(STEPS))
    assert_same_tensors(snapshot(resumed)["weights"], snapshot(uninterrupted)["weights"])
    assert_same_tensors(snapshot(resumed)["moments"], snapshot(uninterrupted)["moments"])


def test_a_committed_step_and_the_latest_pointer(saved):
    root = saved["root"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", f"step-{SAVE_AT}"]
    assert (root / "latest").read_text() == f"step-{SAVE_AT}\n"
    assert latest(root) == saved["path"] and committed_steps(root) == [SAVE_AT]


def test_keep_latest_k_keeps_the_newest_steps(tmp_path):
    learner = LocalLearner(tiny_config())
    (tmp_path / "step-1.tmp").mkdir()  # a save of step 1 that died long ago
    for batch in batches(4):
        train(learner, [batch])
        save(learner, tmp_path, keep_latest_k=2)
    assert committed_steps(tmp_path) == [3, 4]
    assert latest(tmp_path) == tmp_path / "step-4"
    assert not (tmp_path / "step-1.tmp").exists()
    older = LocalLearner(tiny_config())
    assert load(older, tmp_path, step=3) == tmp_path / "step-3" and older.step == 3
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 1 .*steps: \[3, 4\]"):
        load(older, tmp_path, step=1)


def test_saving_the_latest_step_again_is_refused(tmp_path):
    learner = LocalLearner(tiny_config())
    save(learner, tmp_path)
    with pytest.raises(CheckpointError, match="step 0 is already the latest committed checkpoint"):
        save(learner, tmp_path)
    with pytest.raises(ValueError, match="keep_latest_k must be an int >= 0"):
        save(learner, tmp_path, keep_latest_k=-1)


def test_async_save_commits_only_after_the_write(saved, monkeypatch, tmp_path):
    """The write is held back: training goes on, nothing is committed until it is released."""
    root = tmp_path / "async"
    shutil.copytree(saved["root"], root)
    release = threading.Event()
    write_data = FileSystemWriter.write_data

    def held_back(self, plan, planner):
        assert release.wait(60), "the test never released the write"
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_back)
    learner = LocalLearner(tiny_config())
    load(learner, root)
    train(learner, batches(STEPS)[SAVE_AT : SAVE_AT + 1])
    at_save = snapshot(learner)
    handle = save(learner, root, asynchronous=True)
    train(learner, batches(STEPS)[SAVE_AT + 1 :])  # changes the live weights during the write
    assert not handle.done()
    assert latest(root) == root / f"step-{SAVE_AT}", "committed before the write finished"
    assert (root / f"step-{SAVE_AT + 1}.tmp").is_dir()
    release.set()
    assert handle.wait() == root / f"step-{SAVE_AT + 1}"
    assert latest(root) == root / f"step-{SAVE_AT + 1}"
    restored = LocalLearner(tiny_config())
    load(restored, root)
    assert_same_tensors(snapshot(restored)["weights"], at_save["weights"])
    assert_same_tensors(snapshot(restored)["moments"], at_save["moments"])


def test_an_uncommitted_save_is_never_loaded(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved["root"], root)
    shutil.copytree(saved["path"], root / "step-9.tmp")  # complete data, never committed
    learner = LocalLearner(tiny_config())
    assert load(learner, root) == root / f"step-{SAVE_AT}"
    with pytest.raises(CheckpointError, match=r"step-9.tmp is an uncommitted save"):
        load(learner, root / "step-9.tmp")
    (root / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match=r"names '../elsewhere', not a step directory"):
        load(learner, root)


def test_a_directory_without_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint in .*: no 'latest' pointer"):
        load(LocalLearner(tiny_config()), tmp_path)


def test_missing_metadata_is_named(saved, tmp_path):
    path = damaged_copy(saved, tmp_path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"not a loadable DCP checkpoint: its .metadata"):
        load(LocalLearner(tiny_config()), path)


def test_truncated_shard_is_named(saved, tmp_path):
    path = damaged_copy(saved, tmp_path)
    shard = path / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"damaged: __0_0.distcp is truncated: \d+ bytes"):
        load(LocalLearner(tiny_config()), path)


def test_corrupted_shard_is_named_and_nothing_is_loaded(saved, tmp_path):
    path = damaged_copy(saved, tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    learner = LocalLearner(tiny_config())
    before = snapshot(learner)
    with pytest.raises(CheckpointError, match=r"record '.+' in __0_0\.distcp is corrupted \(xxh3"):
        load(learner, path)
    assert_same_tensors(snapshot(learner)["weights"], before["weights"])
    assert learner.step == 0
    # A step saved before checksums existed: the structural damage is still named.
    (path / "checksums.json").unlink()
    with (
        pytest.warns(UserWarning, match="has no checksums.json"),
        pytest.raises(CheckpointError, match=r"__0_0.distcp is corrupted: a record in it"),
    ):
        load(learner, path)
    assert_same_tensors(snapshot(learner)["weights"], before["weights"])


@pytest.mark.parametrize("prefix", ["model.", "optimizer.state.tok_embeddings.weight.exp_avg"])
def test_one_flipped_bit_in_a_weight_or_optimizer_record_is_caught(saved, tmp_path, prefix):
    from titan_learner.checkpoint.records import RAW

    path = damaged_copy(saved, tmp_path)
    key, info = flip_one_bit(path, lambda index, _: index.fqn.startswith(prefix))
    assert info.transform_descriptors == [RAW]  # a raw record: it still decodes
    learner = LocalLearner(tiny_config())
    before = snapshot(learner)
    with pytest.raises(CheckpointError) as info:
        load(learner, path)
    message = str(info.value)
    assert f"checkpoint {path}: record '{key}' in __0_0.distcp is corrupted (xxh3_64 " in message
    assert_same_tensors(snapshot(learner)["weights"], before["weights"])


def test_altered_metadata_is_caught(saved, tmp_path):
    path = damaged_copy(saved, tmp_path)
    metadata = path / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-1] ^= 0x01
    metadata.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"\.metadata (does not match its checksum|is unreadable)"
    ):
        load(LocalLearner(tiny_config()), path)


def other_model(**overrides: int) -> LocalLearner:
    config = tiny_config()
    for name, value in overrides.items():
        setattr(config.model.overrides, name, value)
    return LocalLearner(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"vocab_size": 48},
            r"does not fit this learner.*mismatched: model.tok_embeddings.weight "
            r"\(shape \(32, 64\) saved, shape \(48, 64\) here\)",
        ),
        ({"n_layers": 3}, r"missing from the checkpoint: model.layers.2.attention"),
        ({"n_layers": 1}, r"only in the checkpoint: model.layers.1.attention"),
    ],
    ids=["other-shapes", "more-layers", "fewer-layers"],
)
def test_another_models_checkpoint_lists_the_mismatched_keys(saved, overrides, message):
    learner = other_model(**overrides)
    with pytest.raises(CheckpointError, match=message):
        load(learner, saved["root"])
    assert learner.step == 0


class RunsCode:
    """A pickle that would create `marker` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_that_would_run_code_is_refused(saved, tmp_path):
    """torch 2.13's DCP unpickles .metadata with a bare pickle.load: we never do."""
    path = damaged_copy(saved, tmp_path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata refused: posix.system is not a DCP"):
        load(LocalLearner(tiny_config()), path)
    assert not marker.exists()


def test_an_entry_that_would_run_code_is_refused(saved, tmp_path):
    """DCP's planner reads non-tensor entries with weights_only=False: we use weights_only."""
    learner = LocalLearner(tiny_config())
    state = learner.checkpoint()
    marker = tmp_path / "ran"
    state["step"] = RunsCode(marker)
    state["rng"] = {"rank0": {"cpu": torch.get_rng_state()}}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "evil"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"entry 'step' refused: .*GLOBAL posix.system"):
        load(learner, tmp_path / "evil")
    assert not marker.exists()


def test_a_save_killed_before_its_commit_leaves_the_previous_one(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved["root"], root)
    marker = tmp_path / "stalled"
    process = mp.get_context("spawn").Process(
        target=killed_while_saving, args=(str(root), str(marker))
    )
    process.start()
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.is_alive(), "the saving process died before reaching the commit"
            assert time.monotonic() < deadline, "the saving process never reached the commit"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
    finally:
        if process.is_alive():
            process.kill()
    assert process.exitcode == -signal.SIGKILL
    assert (root / f"step-{SAVE_AT + 1}.tmp" / ".metadata").is_file(), "the data was not written"
    assert latest(root) == root / f"step-{SAVE_AT}"
    learner = LocalLearner(tiny_config())
    assert load(learner, root) == root / f"step-{SAVE_AT}"
    assert_same_tensors(snapshot(learner)["weights"], saved["state"]["weights"])


def test_a_dead_partial_save_is_replaced_by_the_next_save(saved, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(saved["root"], root)
    dead = root / f"step-{SAVE_AT + 1}.tmp"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"half a shard")
    learner = LocalLearner(tiny_config())
    load(learner, root)
    train(learner, batches(STEPS)[SAVE_AT : SAVE_AT + 1])
    assert save(learner, root).wait() == root / f"step-{SAVE_AT + 1}"
    assert not dead.exists() and committed_steps(root) == [SAVE_AT, SAVE_AT + 1]


def test_each_ranks_local_tensors_round_trip(saved, tmp_path):
    """What the job keeps per rank at a preemption (its queued rollouts): any shapes and
    dtypes, back exactly; a checkpoint without them loads with none, and loads without asking."""
    local = {
        "step4_completion_tokens": torch.arange(12).reshape(3, 4),
        "step4_completion_log_probs": torch.randn(3, 4),
        "step4_finished": torch.tensor([True, False, True]),
        "step4_seconds": torch.tensor([0.25], dtype=torch.float64),
    }
    learner = LocalLearner(tiny_config())
    save(learner, tmp_path, local=local).wait()
    back: dict = {}
    load(LocalLearner(tiny_config()), tmp_path, local=back)
    assert back.keys() == local.keys()
    for name, tensor in local.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    load(LocalLearner(tiny_config()), tmp_path)  # not asked for: left alone
    none: dict = {}
    load(LocalLearner(tiny_config()), saved["root"], local=none)
    assert none == {}
    with pytest.raises(ValueError, match="local entries are tensors under names without dots"):
        save(learner, tmp_path / "dotted", local={"step.4": torch.zeros(1)})


# -- a world of 4: save at dp_shard=4, load at dp_shard=2 x tp=2 and on one process ----------


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("world4")
    return {"root": root, "ranks": run_world(4, world_of_4, str(root))}


@pytest.mark.slow
def test_fsdp_checkpoint_loads_at_fsdp_x_tp(world4, reference):
    result = world4["ranks"][0]
    saved, loaded = result["saved"], result["loaded"]
    assert result["loaded_path"] == result["path"] and loaded["step"] == SAVE_AT
    assert_same_tensors(loaded["weights"], saved["weights"])
    assert_same_tensors(loaded["moments"], saved["moments"])
    assert_metrics_close(result["fsdp_tp_next"], result["dp4_next"])
    assert_metrics_close(result["dp4_next"], reference["metrics"][SAVE_AT : SAVE_AT + 1])


@pytest.mark.slow
def test_fsdp_checkpoint_loads_into_one_process(world4):
    result = world4["ranks"][0]
    learner = LocalLearner(tiny_config())
    with pytest.warns(UserWarning, match=r"RNG states not restored: .* saved by 4 rank\(s\)"):
        load(learner, world4["root"])
    state = snapshot(learner)
    assert_same_tensors(state["weights"], result["saved"]["weights"])
    assert_same_tensors(state["moments"], result["saved"]["moments"])
    next_step = train(learner, batches(SAVE_AT + 1)[SAVE_AT:])
    assert_metrics_close(next_step, result["dp4_next"])


@pytest.mark.slow
def test_checkpoint_keys_do_not_depend_on_the_layout(world4, world2, reference):
    """Optimizer keys are FQNs: no `_checkpoint_wrapped_module` (AC), no layout in them."""
    layouts = {
        "dp_shard=4": world4["ranks"][0]["saved"]["keys"],
        "dp_shard=2 x tp=2": world4["ranks"][0]["loaded"]["keys"],
        "dp_shard=2 full AC": world2[0]["resume"]["resumed_state"]["keys"],
    }
    for name, keys in layouts.items():
        assert keys == reference["keys"], name
    assert not any("_checkpoint_wrapped_module" in k for k in reference["keys"]["optimizer"])


# -- a world of 2: async resume under FSDP + AC, a corrupted shard, a rank that skips --------


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return run_world(2, world_of_2, str(tmp_path_factory.mktemp("world2")))


@pytest.mark.slow
def test_async_save_then_resume_is_bit_identical_under_fsdp_and_ac(world2, reference):
    result = world2[0]["resume"]
    assert result["committed"].endswith(f"step-{SAVE_AT}")
    assert_metrics_close(result["resumed"], result["uninterrupted"], exact=True)
    for part in ("weights", "moments"):
        assert_same_tensors(result["resumed_state"][part], result["uninterrupted_state"][part])
    assert_metrics_close(result["uninterrupted"], reference["metrics"][SAVE_AT:])
    assert world2[1]["resume"]["resumed"] == result["resumed"], "ranks report the same metrics"


@pytest.mark.slow
def test_a_corrupted_shard_fails_on_every_rank_and_no_rank_loads(world2):
    for rank in world2:
        assert "__1_0.distcp is corrupted" in rank["corrupted"]["error"]
        assert rank["corrupted"]["unchanged"], "a rank loaded its sound records"


@pytest.mark.slow
def test_a_rank_that_skips_a_save_ends_it_with_a_timeout_error(world2):
    outcome = world2[0]["skipped"]
    assert outcome["error"] is not None, "rank 0 saved although rank 1 never joined"
    assert "checkpoint save of step 4" in outcome["error"]
    assert "not every rank joined within 5 s" in outcome["error"]
    assert "Ranks 1 failed" in outcome["error"]
    assert SKIP_TIMEOUT_S <= outcome["seconds"] < SKIP_TIMEOUT_S + 10


def test_a_resume_says_nothing_a_user_cannot_act_on(saved, recwarn):
    load(LocalLearner(tiny_config()), saved["path"])
    assert not [w for w in recwarn if "learning rate" in str(w.message)]


def test_a_killed_latest_write_is_cleaned_at_the_next_save(tmp_path):
    learner = LocalLearner(tiny_config())
    root = tmp_path / "ckpt"
    root.mkdir()
    leftover = root / ".latest.99999.tmp"
    leftover.write_text("step-7\n")
    save(learner, root).wait()
    assert not leftover.exists() and latest(root).name == "step-0"


def test_a_full_disk_names_the_cause_removes_the_partial_step_and_keeps_the_last(
    saved, tmp_path, monkeypatch
):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    root = tmp_path / "ckpt"
    shutil.copytree(saved["path"].parent, root)
    before = latest(root)

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    learner = LocalLearner(tiny_config())
    train(learner, batches(SAVE_AT + 1))
    with pytest.raises(CheckpointError, match=r"No space left on device"):
        save(learner, root)
    assert latest(root) == before
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
