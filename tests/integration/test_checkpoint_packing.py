"""The optimizer's per-parameter settings are one small checkpoint record (checkpoint.packing),
and a checkpoint written before that packing, one record per parameter and setting, still
resumes exactly."""

from __future__ import annotations

import torch

from tests.support.checkpoint_scenarios import assert_resumes_exactly, assert_same_state, train
from tests.support.models import batches, tiny_config
from titan_learner.checkpoint.layout import latest
from titan_learner.checkpoint.packing import pack_param_groups, unpack_param_groups
from titan_learner.checkpoint.safe_read import read_metadata
from titan_learner.checkpoint.save_load import save
from titan_learner.learner import state as learner_state
from titan_learner.learner.local import LocalLearner


def test_pack_and_unpack_are_inverse_and_leave_tensors_alone():
    learner = LocalLearner(tiny_config())
    train(learner, batches(1))
    flat = learner.optimizer.state_dict()
    packed = pack_param_groups(flat)
    assert not any(k.startswith("param_groups.") for k in packed)
    assert all(isinstance(v, torch.Tensor) for k, v in packed.items() if k != "param_groups")
    assert_same_state(unpack_param_groups(packed), flat)
    assert_same_state(unpack_param_groups(flat), flat)  # never packed: unchanged
    (params, settings), *more = packed["param_groups"]  # one group: every setting is shared
    assert not more and len(params) > 10 and dict(settings)["lr"] > 0


def test_the_settings_are_one_record(tmp_path):
    learner = LocalLearner(tiny_config())
    train(learner, batches(1))
    keys = read_metadata(save(learner, tmp_path).wait()).state_dict_metadata
    settings = [k for k in keys if k.startswith("optimizer.param_groups")]
    assert settings == ["optimizer.param_groups"]
    per_parameter = len(learner.optimizer.state_dict()) - len(learner.checkpoint()["optimizer"])
    assert per_parameter > 50, "what one record replaces"


def test_a_checkpoint_saved_one_record_per_setting_resumes_exactly(tmp_path, monkeypatch):
    data = batches(4)
    learner = LocalLearner(tiny_config())
    train(learner, data[:2])
    with monkeypatch.context() as patch:  # the format of checkpoints saved before the packing
        patch.setattr(learner_state, "pack_param_groups", lambda flat: flat)
        save(learner, tmp_path).wait()
    keys = read_metadata(latest(tmp_path)).state_dict_metadata
    assert sum(k.startswith("optimizer.param_groups.") for k in keys) > 50
    assert_resumes_exactly(learner, tmp_path, data[2:])
