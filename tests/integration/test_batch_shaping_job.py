"""The job's step (`train_on`) with DAPO's overlong shaping, `mask_truncated` and a KL in the
reward together: the batch the learner receives holds the advantages of the formulas written
out by hand, from the toy's own reward of each completion, and no trained token on a
truncated row."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_train import TOY
from tests.support.toy import rewards_of
from tests.unit.test_reward_shaping import dapo_by_hand
from titan_learner.config.toml import load_config
from titan_learner.job.grpo import build_generator, read_inputs, sample, sampling_rng, train_on
from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import (
    ADVANTAGE_KEY,
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    REF_LOG_PROBS_KEY,
    trained_mask,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.weights.sinks import GeneratorSink, push_weights

G, PROMPTS, MAX_NEW, BUFFER, PENALTY, COEFF = 4, 4, 8, 3, 0.5, 0.05


def test_train_on_trains_the_shaped_advantages_and_skips_truncated_rows():
    config = load_config(
        TOY,
        [
            f"rollout.group_size={G}",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.overlong_buffer={BUFFER}",
            f"rollout.overlong_penalty={PENALTY}",
            "loss.mask_truncated=true",
            'kl.placement="reward"',
            f"kl.coeff={COEFF}",
        ],
    )
    inputs = read_inputs(config)
    learner = LocalLearner(config)
    reference = ReferenceModel(config)
    generator = build_generator(config, learner, inputs.tokenizer)

    def push() -> None:
        push_weights(learner, GeneratorSink(generator), 2**26, cpu_offload=False, checksum=False)

    def sampled(step: int, prompts: slice):
        rng = sampling_rng(0, step, 0, learner.device)
        return sample(config, learner, generator, inputs.train[prompts], rng)

    push()
    train_on(config, learner, inputs, sampled(1, slice(PROMPTS)), reference, push=push)
    seen = []
    update = learner.update
    learner.update = lambda micro, **kwargs: (seen.append(micro), update(micro, **kwargs))[1]
    step = sampled(2, slice(PROMPTS, 2 * PROMPTS))  # from weights one update off the reference

    result = train_on(config, learner, inputs, step, reference)

    [batch] = seen
    rollout = step.rollout
    finished, lengths = rollout.finished, rollout.completion_lengths.tolist()
    assert finished.any() and not finished.all(), "the fixture needs both kinds of rows"
    overlong = torch.tensor([dapo_by_hand(n, MAX_NEW, BUFFER, PENALTY) for n in lengths])
    assert (overlong < 0).any() and (overlong == 0).any()
    response = batch.get(ASSISTANT_MASK_KEY)
    ref = batch.get(REF_LOG_PROBS_KEY)
    # k1 summed over each completion: its sampled tokens' behaviour log-probs (the rollout's,
    # truncated rows included) less the reference's at the same positions
    kl = torch.stack(
        [
            (rollout.completion_log_probs[i, :n] - ref[i][response[i]]).sum()
            for i, n in enumerate(lengths)
        ]
    )
    assert kl.abs().max() > 1e-3, "one update off the reference: a KL to penalize"
    shaped = (rewards_of(rollout) + overlong - COEFF * kl).view(-1, G)
    want = (shaped - shaped.mean(1, keepdim=True)) / (shaped.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(
        batch.get(ADVANTAGE_KEY).reshape(-1), want.reshape(-1), atol=1e-4, rtol=1e-4
    )
    trained = trained_mask(response, batch.get(LOG_PROBS_KEY))
    assert not trained[~finished].any()
    assert torch.equal(trained[finished], response[finished])
    metrics = result.metrics
    assert metrics["overlong_penalty_mean"] == pytest.approx(float(overlong.mean()), abs=1e-6)
    assert metrics["kl_reward_mean"] == pytest.approx(float(COEFF * kl.mean()), abs=1e-6)
    assert metrics["reward_mean"] == pytest.approx(float(rewards_of(rollout).mean()), abs=1e-6)
