"""The embedded generator on a tiny LlamaForCausalLM and the Rollout -> batch conversion (the
vLLM generator against a real engine: tests/integration/test_vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from tests.support.toy import EOS_ID, MAX_NEW, PAD_ID, VOCAB_SIZE, rewards_of, sample_prompts
from titan_learner.job.advantage import group_advantages
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.forward.policy import left_justify_order
from titan_learner.rollout.base import GROUP_ID_KEY, REWARD_KEY, Generator, rollout_from_lists
from titan_learner.rollout.hf import HFGenerator
from titan_learner.weights.matching import WeightsError

G = 4


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def new_generator(init_seed: int = 0) -> HFGenerator:
    return HFGenerator(tiny_llama_config(), eos_id=EOS_ID, pad_id=PAD_ID, init_seed=init_seed)


@pytest.fixture(scope="module")
def hf() -> HFGenerator:
    return new_generator()


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    return sample_prompts(n, torch.Generator().manual_seed(seed))


def rollout(hf: HFGenerator, seed: int = 0, temperature: float = 1.0, n_prompts: int = 6):
    return hf.generate(
        prompts(n_prompts), G, MAX_NEW, temperature, torch.Generator().manual_seed(seed)
    )


def as_batch(r):
    rewards = rewards_of(r)
    return r.to_batch(group_advantages(rewards, r.group_size), rewards)


def teacher_forced_log_probs(model, batch) -> torch.Tensor:
    """log p(token t | tokens < t) for every real position, in the batch's left-padded layout.

    Each row is left-justified (real tokens first) so the plain causal forward sees no padding
    before any real token; the result is moved back to the batch's layout.
    """
    order = left_justify_order(batch[ATTENTION_MASK_KEY])
    justified = batch[TOKENS_KEY].gather(1, order)
    with torch.no_grad():
        logits = model(input_ids=justified).logits.float()
    scored = torch.log_softmax(logits[:, :-1], -1).gather(-1, justified[:, 1:, None])[..., 0]
    scored = torch.cat([torch.full_like(scored[:, :1], torch.nan), scored], dim=1)
    return scored.gather(1, torch.argsort(order, dim=1))


def test_implements_the_interface(hf):
    assert isinstance(hf, Generator)


def test_rollout_shapes_and_stopping(hf):
    r = rollout(hf)
    n = 6 * G
    assert r.num_sequences == n and r.completion_tokens.shape[0] == n
    assert r.completion_tokens.shape[1] <= MAX_NEW
    assert r.group_ids.tolist() == [p for p in range(6) for _ in range(G)]
    for row, ids in enumerate(r.completion_ids):
        length = int(r.completion_lengths[row])
        assert len(ids) == length >= 1
        if r.finished[row]:  # stopped at its first EOS
            assert ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
        else:  # ran out of tokens
            assert length == MAX_NEW and EOS_ID not in ids
        assert (r.completion_tokens[row, length:] == PAD_ID).all()
        lps = r.completion_log_probs[row]
        assert torch.isfinite(lps[:length]).all() and (lps[:length] <= 0).all()
        assert lps[length:].isnan().all()
    assert r.finished.any() and not r.finished.all()  # a random model does both here


def test_reproducible_under_a_seed(hf):
    a, b, c = rollout(hf, seed=1), rollout(hf, seed=1), rollout(hf, seed=2)
    assert torch.equal(a.completion_tokens, b.completion_tokens)
    assert torch.equal(a.completion_log_probs.nan_to_num(), b.completion_log_probs.nan_to_num())
    assert not torch.equal(a.completion_tokens, c.completion_tokens)


def test_greedy_samples_are_identical_within_a_group(hf):
    r = rollout(hf, temperature=0.0)
    tokens = r.completion_tokens.view(6, G, -1)
    assert (tokens == tokens[:, :1]).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_log_probs_equal_a_teacher_forced_forward(hf, temperature):
    """Temperature-1 log-probs of the sampled tokens, at any sampling temperature."""
    batch = as_batch(rollout(hf, seed=3, temperature=temperature, n_prompts=16))
    expected = teacher_forced_log_probs(hf.model, batch)
    response = batch[ASSISTANT_MASK_KEY]
    got = batch[LOG_PROBS_KEY]
    torch.testing.assert_close(got[response], expected[response], atol=1e-5, rtol=0)
    assert got[~response].isnan().all()


def test_to_batch_is_a_valid_learner_batch(hf):
    r = rollout(hf)
    batch = as_batch(r)
    checked = check_batch(batch, vocab_size=14, needs_ref_log_probs=False)
    assert checked["advantage"].shape == (r.num_sequences, 1, 1)
    attention, response = batch[ATTENTION_MASK_KEY], batch[ASSISTANT_MASK_KEY]
    length = batch[TOKENS_KEY].shape[1]
    for row, completion in enumerate(r.completion_ids):
        prompt = r.prompts[row // G]
        real = batch[TOKENS_KEY][row][attention[row]].tolist()
        assert real == prompt + completion  # left-padded: the real tokens end the row
        assert attention[row, length - len(real) :].all()
        assert response[row].sum() == len(completion) and response[row, -len(completion) :].all()
    assert attention[:, -1].all() and not attention[:, 0].all()  # ragged rows, left padding
    torch.testing.assert_close(batch[REWARD_KEY], rewards_of(r))
    assert batch[GROUP_ID_KEY].tolist() == r.group_ids.tolist()


def test_to_batch_rejects_a_wrong_advantage_shape(hf):
    r = rollout(hf)
    with pytest.raises(ValueError, match="advantage must hold one value per sequence"):
        r.to_batch(torch.zeros(r.num_sequences + 1), torch.zeros(r.num_sequences))


def test_rollout_from_lists_matches(hf):
    r = rollout(hf)
    lengths = r.completion_lengths.tolist()
    log_probs = [row[:n] for row, n in zip(r.completion_log_probs.tolist(), lengths, strict=True)]
    rebuilt = rollout_from_lists(
        r.prompts, G, r.completion_ids, log_probs, EOS_ID, PAD_ID, r.weights_version
    )
    assert torch.equal(rebuilt.completion_tokens, r.completion_tokens)
    assert torch.equal(rebuilt.finished, r.finished)
    assert torch.equal(
        rebuilt.completion_log_probs.nan_to_num(), r.completion_log_probs.nan_to_num()
    )


def test_generate_argument_errors(hf):
    gen = torch.Generator()
    with pytest.raises(ValueError, match="prompts is empty"):
        hf.generate([], G, MAX_NEW, 1.0, gen)
    with pytest.raises(ValueError, match=r"outside \[0, 14\)"):
        hf.generate([[11, 14, 12]], G, MAX_NEW, 1.0, gen)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        hf.generate(prompts(), 0, MAX_NEW, 1.0, gen)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        hf.generate(prompts(), G, 0, 1.0, gen)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        hf.generate(prompts(), G, MAX_NEW, -1.0, gen)
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        hf.generate(prompts(), G, MAX_NEW, 1.0, None)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_load_weights_copies_in_place():
    source, target = new_generator(init_seed=1), new_generator(init_seed=2)
    params_before = {n: p.data_ptr() for n, p in target.model.named_parameters()}
    target.load_weights(source.model.state_dict().items(), version=7)
    assert target.weights_version == 7
    for name, value in source.model.state_dict().items():
        assert torch.equal(target.model.state_dict()[name], value), name
    assert params_before == {n: p.data_ptr() for n, p in target.model.named_parameters()}
    a, b = rollout(source, seed=5), rollout(target, seed=5)
    assert torch.equal(a.completion_tokens, b.completion_tokens)
    assert b.weights_version == 7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shape", r"wrong shapes: lm_head.weight: got \(13, 64\), the model has \(14, 64\)"),
        ("missing", "missing parameters: model.norm.weight"),
        ("unknown", "unknown names .*: model.layers.9.mlp.up_proj.weight"),
    ],
)
def test_load_weights_rejects_and_leaves_weights_unchanged(change, message):
    target = new_generator(init_seed=2)
    weights = dict(new_generator(init_seed=1).model.state_dict())
    if change == "shape":
        weights["lm_head.weight"] = weights["lm_head.weight"][:13]
    elif change == "missing":
        del weights["model.norm.weight"]
    else:
        weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 64)
    before = state(target.model)
    with pytest.raises(WeightsError, match=f"nothing was copied: {message}"):
        target.load_weights(weights.items(), version=1)
    for name, value in target.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert target.weights_version == 0


def test_qwen3_with_tied_embeddings():
    config = Qwen3Config(
        vocab_size=14,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    source = HFGenerator(config, eos_id=EOS_ID, pad_id=PAD_ID, init_seed=1)
    target = HFGenerator(config, eos_id=EOS_ID, pad_id=PAD_ID, init_seed=2)
    # TorchTitan's qwen3 export has no lm_head key; a full state_dict has it as an alias
    named = [(k, v) for k, v in source.model.state_dict().items() if k != "lm_head.weight"]
    target.load_weights(named, version=1)
    target.load_weights(source.model.state_dict().items(), version=2)
    assert torch.equal(target.model.lm_head.weight, source.model.model.embed_tokens.weight)
    disagreeing = dict(source.model.state_dict())
    disagreeing["lm_head.weight"] = disagreeing["lm_head.weight"] + 1
    with pytest.raises(WeightsError, match=r"are one tied parameter .* the tensors sent differ"):
        target.load_weights(disagreeing.items(), version=3)
    assert target.weights_version == 2
    batch = as_batch(rollout(target, seed=4))
    expected = teacher_forced_log_probs(target.model, batch)
    response = batch[ASSISTANT_MASK_KEY]
    torch.testing.assert_close(
        batch[LOG_PROBS_KEY][response], expected[response], atol=1e-5, rtol=0
    )


def test_unsupported_model_type():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported: llama, qwen3"):
        HFGenerator(GPT2Config(), eos_id=0, pad_id=0)


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_log_probs_match_the_learner_after_a_weight_push(name):
    """The on-policy importance ratio is 1: a learner's exported weights, loaded here, give the
    learner's own log-probs for the sampled tokens (the trainer/inference mismatch check)."""
    from titan_learner.config.toml import config_from_dict
    from titan_learner.learner.local import LocalLearner
    from titan_learner.model.hf_config import hf_config

    overrides = {"vocab_size": 14, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    if name == "qwen3":
        overrides["head_dim"] = 16
    config = config_from_dict(
        {"model": {"name": name, "overrides": overrides}, "run": {"seed": 1}}, source="test"
    )
    learner = LocalLearner(config)
    embedded = HFGenerator(hf_config(learner.spec), eos_id=EOS_ID, pad_id=PAD_ID)
    embedded.load_weights(learner.get_weights(dtype=torch.float32).items(), version=1)
    batch = as_batch(rollout(embedded, seed=6, n_prompts=16))
    with torch.no_grad():
        logits = learner.policy.token_logits(batch[TOKENS_KEY], batch[ATTENTION_MASK_KEY])
    learner_log_probs = torch.log_softmax(logits, -1).gather(-1, batch[TOKENS_KEY][..., None])
    response = batch[ASSISTANT_MASK_KEY]
    torch.testing.assert_close(
        batch[LOG_PROBS_KEY][response], learner_log_probs[..., 0][response], atol=1e-5, rtol=0
    )
