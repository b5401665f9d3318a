"""[checkpoint] export_hf: the export process of a saved step, and what a failed one leaves (a
warning naming the step and the command to export it later; the checkpoint as it was)."""

from __future__ import annotations

import json

import pytest

from tests.support.models import batches, tiny_config
from titan_learner.checkpoint.layout import committed_steps
from titan_learner.job.hf_exports import HFExports
from titan_learner.learner.local import LocalLearner


@pytest.fixture
def saved(tmp_path):
    """A checkpoint root holding step 1 of a tiny learner, and its save handle."""
    learner = LocalLearner(tiny_config("llama3", learner={"export_dtype": "float32"}))
    learner.update(batches(1)[0])
    root = tmp_path / "checkpoints"
    handle = learner.save(str(root))
    return root, handle


def test_a_saved_step_gets_its_export_beside_it(saved):
    root, handle = saved
    exports = HFExports(root)
    exports.after_save(handle, 1, asynchronous=True)
    exports.wait()
    exported = root / "step-1" / "hf"
    assert json.loads((exported / "config.json").read_text())["dtype"] == "float32"
    assert (exported / "model.safetensors").is_file()
    assert committed_steps(root) == [1]


def test_a_failed_export_is_a_warning_and_the_checkpoint_stays(saved):
    root, handle = saved
    (root / "config.toml").unlink()  # the export cannot know the model
    with pytest.warns(UserWarning) as caught:
        HFExports(root).after_save(handle, 1, asynchronous=False)
    [warning] = [str(w.message) for w in caught if "export of step" in str(w.message)]
    assert warning.startswith(
        f"export of step 1 to {root / 'step-1' / 'hf'} failed (error: no config for checkpoint "
    )
    assert warning.endswith(
        f"the checkpoint is intact: titan-learner export --checkpoint {root} --step 1"
    )
    assert not (root / "step-1" / "hf").exists() and committed_steps(root) == [1]
