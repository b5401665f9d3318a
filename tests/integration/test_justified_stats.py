"""A batch that fits one lm_head chunk is scored whole, in its justified layout, without a host
read (titan_learner.learner.forward.justified_stats): its distribution answers as the chunked path's
(chunks smaller than the batch) and the dense one, values and gradients, on rows of varied
lengths whose first tokens are scored; what it does not precompute (other values, a lazy
entropy, samples) it answers through the chunked path's scorer, built on demand."""

from __future__ import annotations

import math

import pytest
import torch
from torchrl.modules.distributions.utils import sample_and_log_prob

from tests.support.models import SEQ_LEN, VOCAB, batches, policy_distribution, tiny_config
from titan_learner.learner.batch import ATTENTION_MASK_KEY, TOKENS_KEY, check_batch
from titan_learner.learner.forward.justified_stats import _JustifiedTokenStats
from titan_learner.learner.forward.logprobs import (
    IGNORE_INDEX,
    ChunkedTokenCategorical,
    TokenScorer,
)
from titan_learner.learner.local import LocalLearner

TOL = 1e-5
WHOLE, CHUNKS = 1024, 5  # the default chunk holds the 8 x 16 batch; 5 splits it


@pytest.fixture(scope="module")
def learner() -> LocalLearner:
    return LocalLearner(tiny_config())


@pytest.fixture(scope="module")
def batch():
    return check_batch(batches(1, varied=True)[0], VOCAB, needs_ref_log_probs=False)


def with_scored_padding(batch):
    """The batch with ignore_index as one padding position's token, and a mask of every real
    token (each row's first among them: the uniform case) and that padding position (scored
    as 0, as TorchRL's masked categorical does); and the padding position's row."""
    attention = batch.get(ATTENTION_MASK_KEY)
    row = int(attention.sum(1).argmin())  # the shortest row has padding before it
    mask = attention.clone()
    mask[row, 0] = True
    tokens = batch.get(TOKENS_KEY).clone()
    tokens[row, 0] = IGNORE_INDEX  # padding: never an embedding lookup
    batch = batch.clone()
    batch.set(TOKENS_KEY, tokens)
    return batch, mask, row


def distribution(learner, batch, mask, chunk_size, compute_entropy=True):
    dist = policy_distribution(learner, batch, mask, chunk_size, compute_entropy)
    assert isinstance(dist, ChunkedTokenCategorical) == (chunk_size > 0)
    return dist


def scores_and_grads(learner, batch, mask, chunk_size):
    """Log-probs and entropies, and the parameter gradients of a weighted sum of both (chunk
    size 0: the dense path's, TorchRL's masked categorical over `[B, T, V]` logits)."""
    learner.model.zero_grad(set_to_none=True)
    dist = distribution(learner, batch, mask, chunk_size)
    tokens = batch.get(TOKENS_KEY)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(2, *mask.shape, generator=generator)
    token, entropy = dist.log_prob(tokens), dist.entropy()
    ((token * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in learner.model.named_parameters()}
    return token.detach(), entropy.detach(), grads


def test_whole_batch_scores_and_gradients_equal_the_chunked_and_dense_paths(learner, batch):
    batch, mask, row = with_scored_padding(batch)
    whole = scores_and_grads(learner, batch, mask, WHOLE)
    for chunk_size in (CHUNKS, 0):
        other = scores_and_grads(learner, batch, mask, chunk_size)
        torch.testing.assert_close(whole[0], other[0], atol=TOL, rtol=0)
        torch.testing.assert_close(whole[1], other[1], atol=TOL, rtol=0)
        for name, grad in other[2].items():
            torch.testing.assert_close(whole[2][name], grad, atol=TOL, rtol=0, msg=name)
    token = whole[0]
    assert token[row, 0] == 0 and (token[~mask] == 0).all() and (whole[1][~mask] == 0).all()
    firsts = torch.arange(len(mask)), batch.get(ATTENTION_MASK_KEY).int().argmax(1)
    torch.testing.assert_close(token[firsts], torch.full_like(token[firsts], -math.log(VOCAB)))


def test_whole_batch_answers_the_rest_through_a_scorer_built_on_demand(learner, batch):
    """Other values, the entropy left out of the forward and samples: the chunked path's
    answers (the scorer, and its host read, only once asked)."""
    mask = batch.get(ATTENTION_MASK_KEY)
    tokens = batch.get(TOKENS_KEY)
    others = (tokens + 3) % VOCAB
    with torch.no_grad():
        whole = distribution(learner, batch, mask, WHOLE, compute_entropy=False)
        chunked = distribution(learner, batch, mask, CHUNKS, compute_entropy=False)
        assert whole._entropy is None and callable(whole._scorer_source)
        torch.testing.assert_close(whole.log_prob(others), chunked.log_prob(others))
        torch.testing.assert_close(whole.entropy(), chunked.entropy(), atol=TOL, rtol=0)
        drawn, log_prob = sample_and_log_prob(whole, (2,))
    assert whole.event_shape == (VOCAB,) and whole.batch_shape == mask.shape
    assert drawn.shape == (2, *mask.shape) and (drawn[:, ~mask] == IGNORE_INDEX).all()
    assert log_prob.isfinite().all() and (log_prob[:, ~mask] == 0).all()


def test_only_small_logits_are_scored_whole(learner, batch, monkeypatch):
    """A batch that fits the chunk but whose logits exceed `WHOLE_BATCH_LOGITS` (where the
    lm_head's work on unscored positions would cost more than it saves) takes the chunked
    path, with its scorer built at once."""
    from titan_learner.learner.forward import policy

    mask = batch.get(ATTENTION_MASK_KEY)
    logits = batch.get(TOKENS_KEY).numel() * VOCAB
    for limit, whole in ((logits, True), (logits - 1, False)):
        monkeypatch.setattr(policy, "WHOLE_BATCH_LOGITS", limit)
        with torch.no_grad():
            dist = distribution(learner, batch, mask, WHOLE)
        assert isinstance(dist._scorer_source, TokenScorer) is not whole


def test_whole_batch_runs_every_position_through_the_decoder_once(learner, batch):
    """No host read decides a shorter width: the decoder runs the batch's whole width, once."""
    widths = []
    hook = learner.model.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape))
    try:
        with torch.no_grad():
            distribution(learner, batch, batch.get(ATTENTION_MASK_KEY), WHOLE)
    finally:
        hook.remove()
    assert widths == [(len(batch.get(TOKENS_KEY)), SEQ_LEN)]


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("from_logits", [False, True], ids=["states and weight", "logits"])
def test_justified_token_stats_gradient_is_exact(with_entropy, from_logits):
    """The hand-written backward against finite differences in float64, from the states and
    the weight or from the logits, on left-justified rows of varied lengths, with padding ids
    out of the vocabulary."""
    generator = torch.Generator().manual_seed(0)
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.bool)
    tokens = torch.randint(0, 7, attention.shape, generator=generator)
    tokens[~attention] = 10**6  # padding ids are never read
    keep = attention & (torch.rand(attention.shape, generator=generator) < 0.8)
    order = torch.argsort(attention, dim=1, descending=True, stable=True)
    weight = torch.randn(7, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    states = torch.randn(3, 5, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(15, 7, generator=generator, dtype=torch.float64, requires_grad=True)

    def stats(*inputs):
        if from_logits:
            return _JustifiedTokenStats.apply(inputs[0], None, tokens, order, keep, with_entropy)
        return _JustifiedTokenStats.apply(*inputs, tokens, order, keep, with_entropy)

    torch.autograd.gradcheck(
        lambda *inputs: tuple(out for out in stats(*inputs) if out is not None),
        (logits,) if from_logits else (states, weight),
    )
