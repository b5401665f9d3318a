"""The GRPO job with [model.lora] on two gloo ranks (FSDP): the KL reference is the base (the
adapters off, zero KL before the first step), and a resume continues exactly."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_train import interrupted_and_whole, training_lines
from tests.support.worlds import run_world

LORA = ["model.lora.rank=8", "loss.kl_to_ref_coeff=0.05", "parallelism.dp_shard=2"]


@pytest.mark.slow
def test_a_lora_job_anchors_its_kl_at_the_base_and_resumes_exactly(tmp_path):
    runs, _ = run_world(2, interrupted_and_whole, str(tmp_path), (*LORA, "eval.every_steps=0"))
    whole = runs["whole"]
    # B starts at zero: the first step's policy is the base, so its KL to the reference is 0
    assert whole[0]["loss_kl_to_ref"] == 0.0
    assert all(m["loss_kl_to_ref"] > 0 for m in whole[1:])
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in whole)  # merged push, fp32
    for got, want in zip(runs["first"] + runs["resumed"], whole, strict=True):
        for key in ("reward_mean", "loss_objective", "loss_kl_to_ref", "grad_norm"):
            assert got[key] == want[key], key
    assert [line["step"] for line in training_lines(tmp_path / "cut")] == [1, 2, 3, 4]
    checkpoints = tmp_path / "cut" / "checkpoints"
    record = json.loads((checkpoints / "lora_base.json").read_text())
    assert set(record) == {"fingerprint", "hf_checkpoint"} and record["hf_checkpoint"] is None
