"""Values that follow from several keys of a config, for whoever needs them (the job's checks,
the engines, the server command line)."""

from __future__ import annotations

from titan_learner.config.env_values import multi_turn
from titan_learner.config.schema import Config


def longest_sequence(config: Config) -> int:
    """The most positions a prompt and its completion take, in training or evaluation (a
    whole episode with [env] or [[tool]])."""
    if multi_turn(config):
        return episode_tokens(config)
    return config.data.max_prompt_tokens + max(
        config.rollout.max_new_tokens, config.eval.max_new_tokens
    )


def episode_tokens(config: Config) -> int:
    """[env] max_total_tokens, or what max_turns turns of the longest max_new_tokens take after
    the longest prompt (0's meaning)."""
    longest_new = max(config.rollout.max_new_tokens, config.eval.max_new_tokens)
    return config.env.max_total_tokens or (
        config.data.max_prompt_tokens + config.env.max_turns * longest_new
    )


def engine_model_path(config: Config) -> str | None:
    """The HF directory the engines start from: [rollout] model_path, else [model]
    hf_checkpoint (both relative to the directory the job is launched from)."""
    return config.rollout.model_path or config.model.hf_checkpoint
