"""Episodes on the embedded HF generator (a tiny random Llama over the test tokenizer): a
one-turn episode is the single-turn rollout, id for id and log-prob for log-prob; in a
multi-turn episode the behaviour log-probs the generator returned are those a fresh forward of
the whole episode gives at the sampled positions (nothing misaligned by the appended turns)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tests.support.hf_dirs import eos_ids, make_tokenizer
from titan_learner.env.environment import Answer
from titan_learner.env.episode import EpisodeSetup, Limits, run_episodes
from titan_learner.env.render import ChatRenderer
from titan_learner.env.tool_calls import parse_hermes
from titan_learner.rollout.hf import HFGenerator

QUESTIONS = ["What is 2 + 3?", "Compute 12 * 4.", "Natalia sold 48 clips."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def generator(tokenizer) -> HFGenerator:
    """Random weights, and an output bias that makes an EOS likely (a turn ends in a few
    tokens, as a trained model's would)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    eos = eos_ids(tokenizer)
    hf = HFGenerator(config, eos_id=eos, pad_id=tokenizer.pad_token_id, init_seed=3)
    head = hf.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos[0]] = 5.0
    hf.model.lm_head = biased
    return hf


class GoOn:
    """A user simulator: asks for more twice, then the episode is done."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, completion):
        asked = sum(m["role"] == "user" for m in messages)
        return [{"role": "user", "content": "Go on."}], None, asked >= 3


def setup_for(tokenizer, make_env, max_turns: int, max_new_tokens: int = 12) -> EpisodeSetup:
    return EpisodeSetup(
        renderer=ChatRenderer(tokenizer, tokenizer.chat_template, None),
        make_env=make_env,
        env_name="[env] class 'sim.py:GoOn'",
        tools={},
        parse=parse_hermes,
        limits=Limits(max_turns, 4096, max_new_tokens, 5.0),
        eos_ids=eos_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )


def rows() -> list[tuple[dict, str]]:
    return [({"prompt": q}, f"train.jsonl:{i + 1}") for i, q in enumerate(QUESTIONS)]


def test_a_one_turn_episode_is_the_single_turn_rollout(tokenizer, generator):
    answer = lambda: Answer(lambda row: [{"role": "user", "content": row["prompt"]}])  # noqa: E731
    episodes = run_episodes(
        generator, rows(), 4, setup_for(tokenizer, answer, 1), 1.0, torch.Generator().manual_seed(5)
    )
    prompts = [  # as the single-turn job's PromptTokenizer.encode renders them
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS
    ]
    single = generator.generate(prompts, 4, 12, 1.0, torch.Generator().manual_seed(5))
    rollout = episodes.rollout
    assert rollout.prompts == single.prompts
    assert rollout.completion_ids == single.completion_ids
    assert torch.equal(rollout.finished, single.finished)
    width = single.completion_tokens.shape[1]
    assert torch.allclose(
        rollout.completion_log_probs[:, :width], single.completion_log_probs, equal_nan=True
    )
    advantage, reward = torch.randn(12), torch.rand(12)
    one, other = rollout.to_batch(advantage, reward), single.to_batch(advantage, reward)
    for key in other.keys(include_nested=True, leaves_only=True):
        assert torch.allclose(one[key].float(), other[key].float(), equal_nan=True), key


@torch.no_grad()
def test_behaviour_log_probs_are_a_fresh_forward_of_the_whole_episode(tokenizer, generator):
    episodes = run_episodes(
        generator, rows(), 2, setup_for(tokenizer, GoOn, 4), 1.0, torch.Generator().manual_seed(0)
    )
    assert max(e.turns for e in episodes.episodes) >= 2
    multi_turn = 0
    for e in episodes.episodes:
        sequence = torch.tensor([e.prompt + e.ids])
        log_probs = torch.log_softmax(generator.model(input_ids=sequence).logits[0].float(), -1)
        positions = [len(e.prompt) + i for i, s in enumerate(e.sampled) if s]
        scored = [log_probs[p - 1, sequence[0, p]].item() for p in positions]
        behaviour = [lp for lp, s in zip(e.log_probs, e.sampled, strict=True) if s]
        assert scored == pytest.approx(behaviour, abs=1e-4)
        multi_turn += e.turns > 1 and not all(e.sampled)
    assert multi_turn >= 2
