"""Tensor records are raw bytes, hashed as they are written (checkpoint.records), and a
checkpoint written before them (torch.save records, optimizer settings packed one pair each)
still resumes exactly, verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.support.checkpoint_scenarios import (
    assert_resumes_exactly,
    assert_same_state,
    flip_one_bit,
    snapshot,
    train,
)
from tests.support.models import batches, tiny_config
from titan_learner.checkpoint import layout, safe_read, save_load
from titan_learner.checkpoint.errors import CheckpointError
from titan_learner.checkpoint.integrity import (
    CHECKSUMS,
    hash_bytes,
    hash_records,
    write_checksums,
)
from titan_learner.checkpoint.layout import METADATA, tmp_dir
from titan_learner.checkpoint.records import ALIGNMENT, RAW
from titan_learner.checkpoint.safe_read import read_metadata
from titan_learner.checkpoint.save_load import load, save
from titan_learner.learner import state as learner_state
from titan_learner.learner.local import LocalLearner


def trained(steps: int) -> LocalLearner:
    learner = LocalLearner(tiny_config())
    train(learner, batches(steps))
    return learner


def test_a_tensor_record_is_the_tensors_bytes(tmp_path):
    learner = trained(1)
    path = save(learner, tmp_path).wait()
    metadata = read_metadata(path)
    shard = (path / "__0_0.distcp").read_bytes()
    state = learner.checkpoint()
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not isinstance(entry, TensorStorageMetadata):
            assert info.transform_descriptors is None, index.fqn  # DCP's torch.save of a value
            continue
        assert info.transform_descriptors == [RAW] and info.offset % ALIGNMENT == 0, index.fqn
        assert info.length == entry.size.numel() * entry.properties.dtype.itemsize, index.fqn
    weight = state["model"]["tok_embeddings.weight"]
    info = next(
        v for i, v in metadata.storage_data.items() if i.fqn.endswith("tok_embeddings.weight")
    )
    record = shard[info.offset : info.offset + info.length]
    assert record == weight.contiguous().view(torch.uint8).numpy().tobytes()


def test_checksums_hashed_while_writing_equal_the_files(tmp_path):
    path = save(trained(1), tmp_path).wait()
    saved = json.loads((path / CHECKSUMS).read_text())
    assert saved["records"] == hash_records(path, read_metadata(path))
    assert saved["metadata"] == hash_bytes((path / METADATA).read_bytes())


def test_torch_refuses_raw_records_instead_of_misreading_them(tmp_path):
    learner = trained(1)
    path = save(learner, tmp_path).wait()
    with pytest.raises(CheckpointException) as info:
        dcp.load(learner.checkpoint(), storage_reader=FileSystemReader(path), no_dist=True)
    cause, _trace = info.value.failures[0]
    assert str(cause) == f"Unknown extension name='{RAW.split('/')[0]}'"


def pack_as_pairs(flat: dict) -> dict:
    """How the optimizer settings were packed before they were grouped: one pair each."""
    prefix = "param_groups."
    packed = {k: v for k, v in flat.items() if not k.startswith(prefix)}
    packed["param_groups"] = [
        (k.removeprefix(prefix), v) for k, v in flat.items() if k.startswith(prefix)
    ]
    return packed


def commit_with_rehashed_checksums(root: Path, step: int, keep_latest_k: int) -> Path:
    """The commit of saves before raw records: every record hashed again from its file."""
    staged = tmp_dir(root, step)
    write_checksums(staged, hash_records(staged, read_metadata(staged)))
    return layout.commit(root, step, keep_latest_k)


def test_a_checkpoint_of_torch_save_records_resumes_exactly_and_verified(tmp_path, monkeypatch):
    data = batches(4)
    learner = trained(2)
    with monkeypatch.context() as patch:  # how save() wrote before raw records
        patch.setattr(save_load, "RawWriter", FileSystemWriter)
        patch.setattr(save_load, "commit", commit_with_rehashed_checksums)
        patch.setattr(learner_state, "pack_param_groups", pack_as_pairs)
        path = save(learner, tmp_path).wait()
    metadata = read_metadata(path)
    assert not any(info.transform_descriptors for info in metadata.storage_data.values())
    assert_resumes_exactly(learner, tmp_path, data[2:])
    key, _ = flip_one_bit(path, lambda index, _: index.fqn.startswith("optimizer.state."))
    with pytest.raises(CheckpointError, match=rf"record '{key}' in __0_0\.distcp is corrupt"):
        load(LocalLearner(tiny_config()), path)


def test_records_are_hashed_and_copied_from_a_mapping_of_the_file(tmp_path, monkeypatch):
    learner = trained(1)
    save(learner, tmp_path).wait()

    def no_reading(*args):
        raise AssertionError("records were read into memory, not mapped")

    monkeypatch.setattr(safe_read, "_read_ranges", no_reading)
    resumed = LocalLearner(tiny_config())
    load(resumed, tmp_path)
    assert_same_state(snapshot(resumed)["weights"], snapshot(learner)["weights"])


def test_without_populate_read_the_records_are_read_and_still_verified(tmp_path, monkeypatch):
    """A kernel before 5.14 refuses MADV_POPULATE_READ (EINVAL): records are read instead."""
    learner = trained(1)
    path = save(learner, tmp_path).wait()
    monkeypatch.setattr(safe_read, "_MADV_POPULATE_READ", 0x7FFF)  # no kernel knows it: EINVAL
    resumed = LocalLearner(tiny_config())
    load(resumed, tmp_path)
    assert_same_state(snapshot(resumed)["weights"], snapshot(learner)["weights"])
    key, _ = flip_one_bit(path, lambda _, info: bool(info.transform_descriptors))
    with pytest.raises(CheckpointError, match=rf"record '{key}' in __0_0\.distcp is corrupt"):
        load(LocalLearner(tiny_config()), path)
