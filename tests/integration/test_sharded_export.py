"""Export of a checkpoint that a sharded learner of an `hf_checkpoint` run saved: the exported
safetensors hold exactly the weights the learner gathers, also once the model directory moved."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.hf_dirs import make_model_dir
from tests.support.models import batches
from tests.support.worlds import run_world
from titan_learner.checkpoint.hf_export import export_checkpoint
from titan_learner.config.toml import config_from_dict


def train_and_save(rank: int, root: str, base: str, layout: dict) -> dict[str, torch.Tensor]:
    from titan_learner.learner.titan import TitanLearner

    config = config_from_dict(
        {
            "model": {"name": "qwen3", "hf_checkpoint": base},  # no flavor, no overrides
            "parallelism": layout,
            "optimizer": {"lr": 1e-3},
            "run": {"seed": 0},
        }
    )
    learner = TitanLearner.from_config(config)
    for batch in batches(2, varied=True):
        learner.update(batch)
    learner.save(root).wait()
    return dict(learner.get_weights(dtype=torch.float32).items())


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


@pytest.mark.parametrize(
    "layout", [{"tp": 2, "dp_shard": 1}, {"dp_shard": 2}], ids=["tp2", "fsdp2"]
)
def test_a_sharded_hf_checkpoint_run_exports_the_weights_it_gathers(tmp_path, layout):
    base, root = tmp_path / "Qwen3-tiny", tmp_path / "checkpoints"
    make_model_dir(base, "qwen3")
    gathered, elsewhere = run_world(2, train_and_save, str(root), str(base), layout)
    assert elsewhere == {} and gathered
    shutil.move(base, tmp_path / "moved")  # the export reads the recorded architecture
    out = export_checkpoint(root, tmp_path / "hf", torch.float32)
    saved = saved_tensors(out)
    assert set(saved) <= set(gathered) and len(saved) >= len(gathered) - 1  # tied: lm_head once
    for name, tensor in saved.items():
        assert torch.equal(tensor, gathered[name]), name
