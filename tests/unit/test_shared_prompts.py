"""`[learner] share_prompts`: the stream holds each shared prompt once and every token a score
needs, and the learner's results equal those of the unshared batch."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import GROUP, SEQ_LEN, VOCAB, tiny_config
from titan_learner.config.errors import ConfigError
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    TOKENS_KEY,
    grouped_synthetic_batch,
)
from titan_learner.learner.forward.policy import left_justify_order
from titan_learner.learner.forward.shared_prompts import plan_stream
from titan_learner.learner.local import LocalLearner


def expected_stream(tokens, attention, scored) -> list[int]:
    """The stream as the docstring states it, in plain Python: per group of consecutive rows
    with the same non-empty prompt, the prompt once (if any row scores a token), then each
    row's own tokens from its prompt's end up to its last scored position."""
    rows = []
    for ids, real, marks in zip(tokens.tolist(), attention.tolist(), scored.tolist(), strict=True):
        kept = [(i, m) for i, r, m in zip(ids, real, marks, strict=True) if r]
        justified = [i for i, _ in kept]
        marked = [c for c, (_, m) in enumerate(kept) if m]
        first = marked[0] if marked else len(justified)
        needed = marked[-1] if marked else 0
        rows.append((justified[:first], justified[first:needed], needed))
    stream, b = [], 0
    while b < len(rows):
        prompt = rows[b][0]
        end = b + 1
        while end < len(rows) and prompt and rows[end][0] == prompt:
            end += 1
        if any(needed for _, _, needed in rows[b:end]):
            stream += prompt
        for _, own, _ in rows[b:end]:
            stream += own
        b = end
    return stream


def edge_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows a rollout can give: a group of three, a row whose prompt is a prefix of theirs, a
    row scored from its first token, a group led by a row that scores nothing, padding."""
    rows = [  # (prompt, response, scored response?)
        ([5, 6, 7], [8, 9, 2], True),
        ([5, 6, 7], [10], True),
        ([5, 6, 7], [11, 12, 13, 14, 15], True),
        ([5, 6], [7, 8], True),
        ([], [3, 4, 1], True),
        ([20, 21], [], False),  # leads its group, scores nothing: the prompt comes from it
        ([20, 21], [22, 23], True),
        ([20, 21], [24], False),  # nothing scored: its whole row is its prompt, shared by none
    ]
    width = 9
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    attention = torch.zeros(len(rows), width, dtype=torch.bool)
    scored = torch.zeros_like(attention)
    for b, (prompt, response, trained) in enumerate(rows):
        ids = prompt + response
        tokens[b, width - len(ids) :] = torch.tensor(ids)
        attention[b, width - len(ids) :] = True
        if trained:
            scored[b, width - len(response) :] = True
    return tokens, attention, scored


def rollout_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = grouped_synthetic_batch(3, GROUP, SEQ_LEN, VOCAB, torch.Generator().manual_seed(seed))
    return batch.get(TOKENS_KEY), batch.get(ATTENTION_MASK_KEY), batch.get(ASSISTANT_MASK_KEY)


@pytest.mark.parametrize("case", ["edge", "rollout 0", "rollout 1"])
def test_stream_holds_each_shared_prompt_once_and_every_token_a_row_reads(case):
    tokens, attention, scored = edge_batch() if case == "edge" else rollout_batch(int(case[-1]))
    order = left_justify_order(attention)
    plan = plan_stream(tokens, attention, scored, order)
    count = int(plan.keep.sum())
    justified_scored = scored.gather(1, order)
    width = int(torch.where(justified_scored, torch.arange(tokens.shape[1]), 0).amax())
    stream, positions, sharing = plan.layout(count, width)

    assert stream[0].tolist() == expected_stream(tokens, attention, scored)
    # each row, at every position its scored tokens read, sees its own token and position
    for b in range(tokens.shape[0]):
        marked = justified_scored[b].nonzero().flatten().tolist()
        for column in range(marked[-1] if marked else 0):
            at = int(sharing.rows[b, column])
            assert int(stream[0, at]) == int(plan.justified[b, column]), (b, column)
            assert int(positions[0, at]) == column, (b, column)
    # every stream token's output is taken from a row slot that reads that token itself
    slots = sharing.rows.reshape(-1).index_select(0, sharing.sources)
    assert slots.tolist() == list(range(count))


def learners(optimizer: dict | None = None) -> tuple[LocalLearner, LocalLearner]:
    """Two learners from one config and seed (`optimizer`: its [optimizer] section), the second
    sharing prompts."""
    optimizer = optimizer or {}
    plain = LocalLearner(tiny_config(optimizer=optimizer))
    shared = LocalLearner(tiny_config(optimizer=optimizer, learner={"share_prompts": True}))
    return plain, shared


def test_log_probs_entropy_and_gradients_equal_the_unshared_batch():
    plain, shared = learners()
    tokens, attention, scored = edge_batch()
    outputs = []
    for learner in (plain, shared):
        learner.model.zero_grad()
        dist = learner.policy.token_dist(tokens, attention, scored)
        log_probs, entropy = dist.log_prob(tokens), dist.entropy()
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
        outputs.append((log_probs.detach(), entropy.detach(), grads))
    (lp, ent, grads), (lp_shared, ent_shared, grads_shared) = outputs
    torch.testing.assert_close(lp_shared, lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_shared, ent, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_shared[name], grad, atol=1e-6, rtol=0, msg=name)
    # the model's other callers (dense logits) run as before through the wrapped attention
    with torch.no_grad():
        dense = plain.policy.token_logits(tokens, attention)
        torch.testing.assert_close(shared.policy.token_logits(tokens, attention), dense)


def test_updates_on_rollout_batches_equal_the_unshared_learner():
    """Each of three steps, from the same state (weights, Adam moments, counters), gives the
    same metrics and weights. Each step starts from the unshared learner's state: Adam divides
    by each gradient's own running scale, so a float32 rounding in a gradient that cancels to
    ~0 can move one weight by a sizeable part of the learning rate a few steps on, sharing or
    not (a different split over ranks does the same: 3e-5 at lr 1e-3 on an AVX-512 machine).
    At lr 1e-5 such a move stays under the 1e-6 tolerance while a wrong update of any weight
    (a step of ~lr) does not."""
    plain, shared = learners(optimizer={"lr": 1e-5})
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        shared.load_checkpoint(plain.checkpoint())
        batch = grouped_synthetic_batch(4, GROUP, SEQ_LEN, VOCAB, generator)
        want, got = plain.update(batch), shared.update(batch)
        for key in ("loss_objective", "loss_entropy", "entropy", "grad_norm", "kl_approx"):
            assert float(got[key]) == pytest.approx(float(want[key]), abs=1e-6), key
        want, got = plain.get_weights(), shared.get_weights()
        for name in want.keys():
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("settings", "found"),
    [
        ({"learner": {"share_prompts": True, "logprob_chunk_size": 0}}, "logprob_chunk_size = 0"),
        (
            {"learner": {"share_prompts": True}, "model": {"attention": "flex"}},
            "attention = 'flex'",
        ),
    ],
)
def test_share_prompts_without_its_needs_is_one_config_error(settings, found):
    with pytest.raises(ConfigError) as raised:
        tiny_config(**settings)
    message = str(raised.value)
    assert message.startswith("tests: [learner] share_prompts: share_prompts runs the decoder")
    assert found in message
    assert 'allowed: logprob_chunk_size >= 1 and attention = "sdpa" or "auto"' in message


def test_auto_attention_is_sdpa_on_cuda_when_prompts_are_shared():
    from titan_learner.config.validate import attention_backend

    assert attention_backend(tiny_config(), "cuda") == "flex"
    assert attention_backend(tiny_config(learner={"share_prompts": True}), "cuda") == "sdpa"
    assert attention_backend(tiny_config(learner={"share_prompts": True}), "cpu") == "sdpa"
