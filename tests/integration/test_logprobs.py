"""Chunked token log-probs ([learner] logprob_chunk_size > 0) equal the dense [B, T, V] path.

Same weights, same batch: every GRPO-family loss term and every parameter gradient agree within
1e-5 across chunk sizes (dividing the scored positions or not), entropy bonus on and off, and
each masking strategy; three `update` calls end at the same weights. The distribution answers
the rest of what TorchRL's losses may call (other tokens, lazy entropy, sampling), and the
lm_head never sees more than one chunk of positions, in forward or backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torchrl.modules.distributions.utils import sample_and_log_prob

from tests.support.models import SEQ_LEN, VOCAB, batches, policy_distribution, tiny_config
from tests.support.scenarios import run_layouts
from tests.support.worlds import run_world
from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import LossSection
from titan_learner.learner.batch import (
    ATTENTION_MASK_KEY,
    REF_LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.forward.logprobs import (
    ChunkedTokenCategorical,
    TokenScorer,
    _TokenStats,
    chunked_token_stats,
)
from titan_learner.learner.forward.logprobs import _scattered as scattered
from titan_learner.learner.forward.policy import TitanPolicy
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.classes import build_loss

TOL = 1e-5
SCORED = 64  # 8 sequences x 8 response tokens: chunk sizes 5 and 7 divide neither it nor B * T
CHUNK_SIZES = (1, 5, 7, 64, 1000)


@pytest.fixture(scope="module")
def learner() -> LocalLearner:
    return LocalLearner(tiny_config())


@pytest.fixture(scope="module")
def batch():
    batch = batches(1)[0]
    generator = torch.Generator().manual_seed(1)
    batch.set(REF_LOG_PROBS_KEY, -torch.rand(batch.batch_size[0], SEQ_LEN, generator=generator))
    return check_batch(batch, VOCAB, needs_ref_log_probs=True)


def loss_and_grads(learner: LocalLearner, loss, batch, chunk_size: int):
    """Loss terms and all parameter gradients with the policy set to `chunk_size`."""
    learner.policy.logprob_chunk_size = chunk_size
    learner.model.zero_grad(set_to_none=True)
    try:
        out = loss(batch.clone())
    finally:
        learner.policy.logprob_chunk_size = 0
    terms = {k: out.get(k) for k in out.keys() if out.get(k) is not None}
    sum(v for k, v in terms.items() if k.startswith("loss")).backward()
    grads = {name: p.grad.clone() for name, p in learner.model.named_parameters()}
    return {k: v.detach() for k, v in terms.items()}, grads


def assert_close_dicts(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=0, msg=key)


LOSSES = {
    "grpo": {"name": "grpo", "kwargs": {}},
    "grpo no entropy": {"name": "grpo", "kwargs": {"entropy_bonus": False}},
    "grpo generic mask": {"name": "grpo", "kwargs": {"masking_strategy": "generic"}},
    "grpo sft mask": {"name": "grpo", "kwargs": {"masking_strategy": "sft"}},
    "grpo kl prompt_mean": {
        "name": "grpo",
        "kwargs": {
            "kl_to_ref_coeff": 0.1,
            "kl_to_inference_coeff": 0.05,
            "aggregation": "prompt_mean",
        },
    },
    "dapo": {"name": "dapo", "kwargs": {"clip_epsilon": (0.2, 0.28)}},
    "cispo no entropy": {"name": "cispo", "kwargs": {"entropy_bonus": False}},
    "gspo-token row sums": {
        "name": "gspo",
        "kwargs": {"gspo_token": True, "aggregation": "seq_mean_token_sum"},
    },
    "sequence mask correction": {
        "name": "grpo",
        "kwargs": {"correction": {"level": "sequence", "mode": "mask", "low": 0.5}},
    },
}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_loss_terms_and_gradients_match_dense(learner, batch, loss_name):
    section = LossSection(name=LOSSES[loss_name]["name"], kwargs=LOSSES[loss_name]["kwargs"])
    loss = build_loss(section, learner.policy)
    want_terms, want_grads = loss_and_grads(learner, loss, batch, 0)
    assert want_terms["loss_objective"].isfinite()
    for chunk_size in CHUNK_SIZES:
        terms, grads = loss_and_grads(learner, loss, batch, chunk_size)
        assert_close_dicts(terms, want_terms)
        assert_close_dicts(grads, want_grads)


def test_three_updates_end_at_the_same_weights():
    runs = {}
    for chunk_size in (0, 7):
        learner = LocalLearner(tiny_config(learner={"logprob_chunk_size": chunk_size}))
        assert learner.policy.logprob_chunk_size == chunk_size
        metrics = [dict(learner.update(b).items()) for b in batches(3)]
        runs[chunk_size] = (metrics, dict(learner.get_weights(dtype=torch.float32).items()))
    (dense_metrics, dense_weights), (metrics, weights) = runs[0], runs[7]
    for got, want in zip(metrics, dense_metrics, strict=True):
        assert_close_dicts(got, want)
    assert_close_dicts(weights, dense_weights)


def test_config_accepts_and_validates_logprob_chunk_size():
    assert tiny_config().learner.logprob_chunk_size == 1024  # chunked by default
    assert tiny_config(learner={"logprob_chunk_size": 512}).learner.logprob_chunk_size == 512
    with pytest.raises(ConfigError, match=r"\[learner\] logprob_chunk_size: -1 is out of range"):
        tiny_config(learner={"logprob_chunk_size": -1})
    with pytest.raises(ConfigError, match=r"\[learner\] logprob_chunk_size: expected an integer"):
        tiny_config(learner={"logprob_chunk_size": "big"})
    with pytest.raises(ValueError, match="logprob_chunk_size must be >= 0"):
        TitanPolicy(torch.nn.Linear(1, 1), logprob_chunk_size=-1)


def dense_and_chunked(learner, batch, mask, chunk_size=5, compute_entropy=True):
    """The dense LLMMaskedCategorical and the chunked distribution over the same positions."""
    dense = policy_distribution(learner, batch, mask, 0)
    chunked = policy_distribution(learner, batch, mask, chunk_size, compute_entropy)
    assert isinstance(chunked, ChunkedTokenCategorical)
    return dense, chunked


def test_distribution_answers_like_the_dense_one(learner, batch):
    """Other tokens, lazily computed entropy, ignore_index, sampling shapes and ranges."""
    mask = batch.get(ATTENTION_MASK_KEY)  # includes each row's first token: the uniform case
    tokens = batch.get(TOKENS_KEY)
    with torch.no_grad():
        dense, chunked = dense_and_chunked(learner, batch, mask, compute_entropy=False)
        torch.testing.assert_close(chunked.mask, dense.mask)
        assert chunked.batch_shape == dense.batch_shape
        assert chunked.position_level_masking and chunked._position_level_masking
        others = (tokens + 3) % VOCAB
        others[:, -1] = -100
        for value in (tokens, others):
            torch.testing.assert_close(
                chunked.log_prob(value), dense.log_prob(value), atol=TOL, rtol=0
            )
        stacked = torch.stack([dense.log_prob(tokens), dense.log_prob(others)])
        torch.testing.assert_close(chunked.log_prob(torch.stack([tokens, others])), stacked)
        torch.testing.assert_close(chunked.entropy(), dense.entropy(), atol=TOL, rtol=0)
        first = chunked.log_prob(tokens)[torch.arange(len(mask)), mask.int().argmax(1)]
        torch.testing.assert_close(first, torch.full_like(first, -math.log(VOCAB)))
        drawn, log_prob = sample_and_log_prob(chunked, (3,))
    assert drawn.shape == (3, *mask.shape) and log_prob.shape == (3, *mask.shape)
    assert (drawn[:, ~mask] == -100).all()
    assert ((drawn[:, mask] >= 0) & (drawn[:, mask] < VOCAB)).all()
    assert log_prob.isfinite().all() and (log_prob[:, ~mask] == 0).all()


def test_decoder_runs_only_the_positions_the_scores_read(learner, batch):
    """The last justified position of the longest row predicts no token: the decoder stops
    before it, and before any later position no scored token reads, scoring the same."""
    widths = []
    hook = learner.model.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape))
    real = batch.get(ATTENTION_MASK_KEY)
    longest = int(real.sum(1).max())
    early = real & (real.cumsum(1) <= 4)  # each row's first four real tokens
    try:
        with torch.no_grad():
            for mask, width in ((real, longest - 1), (early, 3)):
                dense, chunked = dense_and_chunked(learner, batch, mask)
                assert widths[-1] == (real.shape[0], width)
                tokens = batch.get(TOKENS_KEY)
                torch.testing.assert_close(
                    chunked.log_prob(tokens), dense.log_prob(tokens), atol=TOL, rtol=0
                )
                torch.testing.assert_close(chunked.entropy(), dense.entropy(), atol=TOL, rtol=0)
    finally:
        hook.remove()
    assert longest == SEQ_LEN  # the fixture's longest row fills the batch: one position saved


def test_lm_head_sees_one_chunk_at_a_time(learner, batch, monkeypatch):
    """Forward and backward (recompute) run the lm_head on at most `chunk_size` positions."""
    from titan_learner.learner.forward import logprobs

    rows = []
    full_logits = logprobs._full_logits

    def spy(head, hidden):
        assert head is learner.model.lm_head
        rows.append(hidden.shape[0])
        return full_logits(head, hidden)

    monkeypatch.setattr(logprobs, "_full_logits", spy)
    loss = build_loss(LossSection(), learner.policy)
    try:
        learner.policy.logprob_chunk_size = 7
        out = loss(batch.clone())
        calls_forward = len(rows)
        (out.get("loss_objective") + out.get("loss_entropy")).backward()
    finally:
        learner.policy.logprob_chunk_size = 0
        learner.model.zero_grad(set_to_none=True)
    chunks = math.ceil(SCORED / 7)
    assert calls_forward == chunks and len(rows) == 2 * chunks
    assert max(rows) == 7 and sum(rows) == 2 * SCORED


def log_softmax_stats(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """The same statistics as torch's operators compose them (autograd through each)."""
    log_probs = logits.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return log_probs.gather(-1, targets), entropy


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("targets_shape", [(11, 2), (11,)], ids=["two a position", "one"])
def test_chunked_token_stats_against_log_softmax(with_entropy, targets_shape):
    """Values and gradients (to the hidden states and the lm_head) equal torch's composition,
    for two targets a position (one repeated) or one given as `[N]`, and weighted outputs,
    chunks of 4 of 11; ignored targets (one in two chunks) give 0 and no gradient, as a
    `where` after the composition."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 6, generator=generator, requires_grad=True)
    head = torch.nn.Linear(6, 9, bias=False)
    targets = torch.randint(0, 9, targets_shape, generator=generator)
    ignored = torch.zeros(targets_shape, dtype=torch.bool)
    ignored[2], ignored[9] = True, True
    if len(targets_shape) == 2:
        targets[3, 1] = targets[3, 0]
    token_weight = torch.randn(targets_shape, generator=generator)
    entropy_weight = torch.randn(11, generator=generator)

    def composed():
        index = targets if targets.dim() == 2 else targets.unsqueeze(-1)
        token, entropy = log_softmax_stats(head(hidden), index, with_entropy)
        return torch.where(ignored, 0.0, token.reshape(targets_shape)), entropy

    results = []
    for stats in (
        lambda: chunked_token_stats(hidden, targets, head, 4, with_entropy, ignored),
        composed,
    ):
        hidden.grad = head.weight.grad = None
        token, entropy = stats()
        total = (token * token_weight).sum()
        if with_entropy:
            total = total + (entropy * entropy_weight).sum()
        total.backward()
        results.append((token, entropy, hidden.grad, head.weight.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
    assert (results[0][0][2] == 0).all() and (results[0][0][9] == 0).all()
    empty, _ = chunked_token_stats(hidden[:0], targets[:0], head, 4, with_entropy=False)
    assert empty.shape == (0, *targets_shape[1:]) and empty.requires_grad


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("scored", [13, 40], ids=["13 scored", "40 scored"])
def test_one_node_scoring_equals_the_composition_bit_for_bit(with_entropy, scored):
    """One chunk on a plain lm_head weight is one autograd node (`scattered_stats`): its
    `[B, T]` log-probs and entropies and the gradients of the states and the weight equal those
    of the matmul, `_TokenStats` and the scatters composed, bit for bit (ignored targets
    included). More than one chunk, a bias or a position without a state before it keeps the
    composition."""
    generator = torch.Generator().manual_seed(scored)
    shape = torch.Size([6, 9])
    positions = torch.randperm(shape.numel(), generator=generator)[:scored].sort().values
    states = torch.randn(scored, 16, generator=generator, requires_grad=True)
    head = torch.nn.Linear(16, 11, bias=False)
    targets = torch.randint(0, 11, (scored,), generator=generator)
    ignored = torch.rand(scored, generator=generator) < 0.2
    weights = torch.randn(2, *shape, generator=generator)
    scorer = TokenScorer(states, None, positions, head, vocab_size=11, chunk_size=64)

    def composed():
        token, entropy = _TokenStats.apply(
            F.linear(states, head.weight), targets, with_entropy, ignored
        )
        return scattered(token, positions, shape), entropy is not None and scattered(
            entropy, positions, shape
        )

    results = []
    for score in (lambda: scorer.scattered_stats(targets, with_entropy, ignored, shape), composed):
        states.grad = head.weight.grad = None
        token, entropy = score()
        total = (token * weights[0]).sum() + ((entropy * weights[1]).sum() if with_entropy else 0)
        total.backward()
        results.append((token, entropy if with_entropy else None, states.grad, head.weight.grad))
    for got, want in zip(*results, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    assert (results[0][0].reshape(-1)[positions[ignored]] == 0).all()
    small = TokenScorer(states, None, positions, head, vocab_size=11, chunk_size=scored - 1)
    biased = TokenScorer(states, None, positions, torch.nn.Linear(16, 11), 11, 64)
    first = TokenScorer(states, torch.zeros(scored, dtype=torch.bool), positions, head, 11, 64)
    for other in (small, biased, first):
        assert other.scattered_stats(targets, with_entropy, ignored, shape) is None


@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_token_stats_gradient_is_exact(with_entropy):
    """The hand-written backward against finite differences, in float64, either output alone
    and both together (gradcheck weights each output at random)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, generator=generator, dtype=torch.float64).mul(3).requires_grad_()
    targets = torch.randint(0, 7, (5, 2), generator=generator)
    for picked in ((0,), (1,), (0, 1)) if with_entropy else ((0,),):
        torch.autograd.gradcheck(
            lambda z, picked=picked: tuple(
                _TokenStats.apply(z, targets, with_entropy)[i] for i in picked
            ),
            (logits,),
        )


def test_the_scored_tokens_log_probs_are_zero_at_ignore_index():
    """`log_prob` of the very tensor the distribution scored (what TorchRL's losses pass, read
    without a comparison) answers like any equal tensor: 0 off the mask and at ignore_index,
    also where the position has no state before it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 9, (2, 5), generator=generator)
    tokens[1, 3] = -100
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    positions = mask.reshape(-1).nonzero().squeeze(1)
    unscored = torch.zeros(len(positions), dtype=torch.bool)
    unscored[5] = True  # the ignored token's position: ignore_index wins, as in the dense path
    scorer = TokenScorer(
        hidden=torch.randn(len(positions), 6, generator=generator),
        unscored=unscored,
        positions=positions,
        head=torch.nn.Linear(6, 9, bias=False),
        vocab_size=9,
        chunk_size=3,
    )
    dist = ChunkedTokenCategorical(scorer, tokens, mask)
    scored = dist.log_prob(tokens)
    torch.testing.assert_close(scored, dist.log_prob(tokens.clone()))
    assert scored[1, 3] == 0 and (scored[~mask] == 0).all() and (scored[mask].ne(0).sum() == 6)


def layouts_and_fsdp_passes(rank: int, layouts: dict) -> dict:
    """`run_layouts`, and how often one dp_shard=2 update runs each FSDP group's forward and
    gradient reduction (torch.profiler's FSDP labels)."""
    from torch.profiler import profile

    from titan_learner.learner.titan import TitanLearner

    results = run_layouts(rank, layouts)
    learner = TitanLearner.from_config(tiny_config(**layouts["dp_shard=2"]["sections"]))
    batch = learner.local_batch(batches(1)[0])
    learner.update(batch)  # FSDP's lazy initialization first
    with profile() as prof:
        learner.update(batch)
    labels = [e.key for e in prof.key_averages() if e.key.startswith("FSDP::")]
    results["fsdp passes"] = {k: e.count for e in prof.key_averages() if (k := e.key) in labels}
    return results


@pytest.mark.slow
def test_sharded_chunked_learners_match_dense_local():
    """FSDP (the lm_head a plain matmul on its unsharded weight) and TP (vocab-sharded chunks,
    the lm_head called through its hooks). Under FSDP the chunks stay in the decoder's pass of
    the (norm, lm_head) group: one forward and one gradient reduction a step, as every group."""
    chunked = {"learner": {"logprob_chunk_size": 5}}
    layouts = {
        "dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}, **chunked}},
        "tp=2": {"sections": {"parallelism": {"tp": 2, "dp_shard": 1}, **chunked}},
    }
    rank0, _ = run_world(2, layouts_and_fsdp_passes, layouts)
    passes = rank0.pop("fsdp passes")
    assert passes["FSDP::pre_forward (norm, lm_head)"] == 1, passes
    assert passes["FSDP::post_backward_reduce (norm, lm_head)"] == 1, passes
    assert passes["FSDP::root_pre_forward"] == 1, passes
    local = LocalLearner(tiny_config())
    want = [dict(local.update(b).items()) for b in batches(3)]
    want_weights = dict(local.get_weights(dtype=torch.float32).items())
    for layout in layouts:
        for got, expected in zip(rank0[layout]["metrics"], want, strict=True):
            for key in ("loss_objective", "loss_entropy", "grad_norm"):
                assert got[key] == pytest.approx(float(expected[key]), abs=TOL), (layout, key)
        assert_close_dicts(rank0[layout]["weights"], want_weights)
