"""Values that follow from several keys of a config, for whoever needs them (the job's checks,
the engines, the server command line)."""

from __future__ import annotations

from titan_learner.config.schema import Config


def longest_sequence(config: Config) -> int:
    """The most positions a prompt and its completion take, in training or evaluation."""
    return config.data.max_prompt_tokens + max(
        config.rollout.max_new_tokens, config.eval.max_new_tokens
    )


def engine_model_path(config: Config) -> str | None:
    """The HF directory the engines start from: [rollout] model_path, else [model]
    hf_checkpoint (both relative to the directory the job is launched from)."""
    return config.rollout.model_path or config.model.hf_checkpoint
