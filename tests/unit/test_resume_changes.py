"""Resuming with a changed config: what the checkpoint cannot honour is one line; every other
change is applied (the optimizer's and the loss's settings come from the config, not silently
from the checkpoint) and listed."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import batches, tiny_config
from titan_learner.checkpoint.layout import save_resolved_config
from titan_learner.config.errors import ConfigError
from titan_learner.job.resume import check_resume, config_changes, touches_hyperparameters
from titan_learner.learner.local import LocalLearner

DAPO = {"name": "dapo", "clip_epsilon": [0.2, 0.28]}


def test_changes_are_listed_key_by_key():
    before = tiny_config(loss=DAPO, optimizer={"lr": 1e-3})
    after = tiny_config(loss={**DAPO, "clip_epsilon": [0.2, 0.3]}, optimizer={"lr": 5e-4})
    changes = config_changes(before, after)
    assert [str(c) for c in changes] == [
        "loss.clip_epsilon [0.2, 0.28] -> [0.2, 0.3]",
        "optimizer.lr 0.001 -> 0.0005",
    ]
    assert touches_hyperparameters(changes)
    assert not touches_hyperparameters(
        config_changes(before, tiny_config(loss=DAPO, run={"steps": 99}, optimizer={"lr": 1e-3}))
    )


def test_a_change_of_the_models_shape_is_one_line(tmp_path):
    save_resolved_config(tiny_config(), tmp_path)
    config = tiny_config(model={"overrides": {"dim": 32}})
    config.source = "run.toml"
    with pytest.raises(ConfigError) as info:
        check_resume(tmp_path, config)
    assert str(info.value) == (
        f"run.toml: [model.overrides] dim: the checkpoint in {tmp_path} was trained with dim = 64, "
        "the config says 32; allowed: 64 (what a checkpoint holds cannot change on resume), or "
        "a new output_dir"
    )


def test_the_loss_and_optimizer_settings_come_from_the_config(tmp_path):
    trained = LocalLearner(tiny_config(loss=DAPO, optimizer={"lr": 1e-3}))
    trained.update(batches(1)[0])
    trained.save(str(tmp_path))
    changed = tiny_config(
        loss={**DAPO, "clip_epsilon": [0.1, 0.4]},
        optimizer={"lr": 5e-4, "betas": [0.8, 0.9], "weight_decay": 0.1},
    )
    silently = LocalLearner(changed)
    silently.load(str(tmp_path))  # the checkpoint's settings (what the issue found)
    assert float(silently.loss_module.clip_epsilon_high) == pytest.approx(0.28)
    resumed = LocalLearner(changed)
    resumed.load(str(tmp_path), hyperparameters_from_config=True)
    assert float(resumed.loss_module.clip_epsilon_low) == pytest.approx(0.1)
    assert float(resumed.loss_module.clip_epsilon_high) == pytest.approx(0.4)
    group = resumed.optimizer.optimizers[0].param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (5e-4, (0.8, 0.9), 0.1)
    assert resumed.step == 1  # the state itself is the checkpoint's
    for name, value in trained.checkpoint()["model"].items():
        torch.testing.assert_close(resumed.checkpoint()["model"][name], value, atol=0, rtol=0)
    metrics = resumed.update(batches(2)[1])
    assert float(metrics["lr"]) == pytest.approx(5e-4)
