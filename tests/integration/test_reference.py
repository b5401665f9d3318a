"""The frozen reference model behind `[loss] kl_to_ref_coeff`: log-probs, KL, the GRPO job.

An untrained policy and its reference score every token alike (same initial weights), dense and
chunked; training moves the policy away (`kl_to_ref` 0 at step 1, > 0 after) while the reference
stays put; the job reports the KL terms; a dp_shard=2 (or tp=2) reference scores like one process.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.test_train import short_run
from tests.support.models import VOCAB, batches, tiny_config
from tests.support.worlds import run_world
from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    REF_LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.titan import TitanLearner

KL = {"loss": {"kl_to_ref_coeff": 0.1}, "optimizer": {"lr": 1e-2}}
UPDATES = 4
ACCUMULATE = ["learner.grad_accum_steps=2"]  # the job scores each micro-batch


def one_process(rank: int, output_dir: str) -> dict:
    """Reference vs policy before training, the KL while training, then a short KL job."""
    config = tiny_config(**KL)
    learner = TitanLearner.from_config(config)
    reference = ReferenceModel(config)
    train = batches(UPDATES)
    batch = check_batch(train[0], VOCAB, needs_ref_log_probs=False)
    ref = reference.log_probs(batch)
    # the policy's own log-probs, as TorchRL's masked categorical gives them on every real token
    dist = learner.policy._get_dist_with_attention_mask(batch)
    policy = dist.log_prob(batch.get(TOKENS_KEY)).detach()
    default = reference.policy.logprob_chunk_size
    reference.policy.logprob_chunk_size = 5  # the chunked path scores the same
    chunked = reference.log_probs(batch)
    reference.policy.logprob_chunk_size = 0
    # Rollout-shaped rows, scored where the KL reads them, each group's prompt run once
    grouped = check_batch(batches(1, grouped=True)[0], VOCAB, needs_ref_log_probs=False)
    sharing = ReferenceModel(tiny_config(**KL, learner={"share_prompts": True}))
    kl = []
    for micro in train:
        micro.set(REF_LOG_PROBS_KEY, reference.log_probs(micro))
        metrics = learner.update(micro)
        kl.append({k: float(metrics[k]) for k in ("kl_to_ref", "loss_kl_to_ref")})
    return {
        "batch": batch.select(TOKENS_KEY, ATTENTION_MASK_KEY, ASSISTANT_MASK_KEY),
        "ref": ref,
        "policy": policy,
        "chunked": chunked,
        "ref_after_training": scored_with(reference, default, batch),
        "frozen": all(not p.requires_grad and p.grad is None for p in reference.model.parameters()),
        "eval": not reference.model.training,
        "kl": kl,
        "grouped": grouped.select(ATTENTION_MASK_KEY, ASSISTANT_MASK_KEY),
        "grouped_every_token": reference.log_probs(grouped),
        "grouped_kl": sharing.kl_log_probs(grouped),
        "job": short_run(rank, output_dir, 2, ["loss.kl_to_ref_coeff=0.1", *ACCUMULATE]),
    }


def scored_with(reference: ReferenceModel, chunk_size: int, batch) -> torch.Tensor:
    """The reference's log-probs of `batch` through the path of `chunk_size` (0: dense)."""
    reference.policy.logprob_chunk_size = chunk_size
    return reference.log_probs(batch)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_world(1, one_process, str(tmp_path_factory.mktemp("kl_job")))[0]


def test_untrained_reference_scores_like_the_policy(single):
    real = single["batch"].get(ATTENTION_MASK_KEY)
    ref, policy = single["ref"], single["policy"]
    assert ref.dtype == torch.float32 and ref.shape == real.shape
    torch.testing.assert_close(ref[real], policy[real], atol=1e-6, rtol=0)
    assert (ref[~real] == 0).all(), "padding holds 0.0 (GRPOLoss's ref padding value)"
    first = real.int().argmax(1)  # no predecessor: the uniform distribution's -log V
    torch.testing.assert_close(
        ref.gather(1, first.unsqueeze(1)).squeeze(1), torch.full_like(ref[:, 0], -math.log(VOCAB))
    )
    torch.testing.assert_close(single["chunked"], ref, atol=1e-6, rtol=0)


def test_kl_to_ref_is_zero_at_step_one_then_grows_while_the_reference_stays(single):
    kl = [m["kl_to_ref"] for m in single["kl"]]
    assert abs(kl[0]) < 1e-7, kl
    assert all(k > 1e-5 for k in kl[1:]), kl
    for m in single["kl"]:
        assert m["loss_kl_to_ref"] == pytest.approx(0.1 * m["kl_to_ref"], rel=1e-5, abs=1e-12)
    assert torch.equal(single["ref_after_training"], single["ref"])
    assert single["frozen"] and single["eval"]


def test_kl_log_probs_score_the_response_alone_sharing_prompts(single):
    """What the KL reads (the response, under "rlhf" masking) equals scoring every token."""
    grouped = single["grouped"]
    response = grouped.get(ASSISTANT_MASK_KEY) & grouped.get(ATTENTION_MASK_KEY)
    kl, every = single["grouped_kl"], single["grouped_every_token"]
    assert response.any() and (~response & grouped.get(ATTENTION_MASK_KEY)).any()
    torch.testing.assert_close(kl[response], every[response], atol=1e-6, rtol=0)
    assert (kl[~response] == 0).all()


def test_grpo_job_with_kl_reports_the_kl_terms(single):
    history = single["job"]
    assert len(history) == 2
    for metrics in history:
        for key in ("kl_to_ref", "loss_kl_to_ref"):
            assert key in metrics and math.isfinite(metrics[key]), key
    assert abs(history[0]["kl_to_ref"]) < 1e-7, "step 1 trains the initial policy: no KL yet"
    assert history[1]["kl_to_ref"] > 0


def sharded_reference(rank: int, layouts: dict[str, dict], batch) -> dict[str, tuple]:
    """Each layout's log-probs, twice, and how many parameters stay gathered after them."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, parallelism in layouts.items():
        reference = ReferenceModel(tiny_config(**KL, parallelism=parallelism))
        scores = [reference.log_probs(batch) for _ in range(2)]
        gathered = [n for n, p in reference.model.named_parameters() if not isinstance(p, DTensor)]
        out[name] = (*scores, gathered)
    return out


@pytest.mark.slow
def test_sharded_reference_equals_one_process(single):
    """... and keeps no gathered weight between calls (a full lm_head per rank, otherwise)."""
    layouts = {"dp_shard=2": {"dp_shard": 2}, "tp=2": {"tp": 2, "dp_shard": 1}}
    for rank_out in run_world(2, sharded_reference, layouts, single["batch"]):
        for name, (first, second, gathered) in rank_out.items():
            torch.testing.assert_close(first, single["ref"], atol=1e-5, rtol=0, msg=name)
            assert torch.equal(first, second), name
            assert gathered == [], (name, gathered)
