"""Rollout generators: sample G completions per prompt with behaviour log-probs, take new weights.

One interface, `Generator` (generators.base), two implementations:

- `HFGenerator` (generators.hf): the embedded default, an in-process transformers model
  (LlamaForCausalLM or Qwen3ForCausalLM) built from a config, sampled by a hand loop over a KV
  cache so that a seeded `torch.Generator` makes a rollout reproducible.
- `VLLMGenerator` (generators.vllm): the same contract on a vLLM engine (CUDA only; vllm is
  imported lazily).

The contract (temperature-1 behaviour log-probs, rollout row order, the argument checks) is
documented in generators.base.
"""

from titan_learner.generators.base import (
    GROUP_ID_KEY,
    REWARD_KEY,
    SUPPORTED_MODEL_TYPES,
    Generator,
    Rollout,
    WeightsError,
    check_generate_args,
    check_named_tensors,
    left_pad,
    rollout_from_lists,
)
from titan_learner.generators.hf import HFGenerator
from titan_learner.generators.vllm import VLLMGenerator, VLLMWeightLoader, hf_parameter_shapes

__all__ = [
    "GROUP_ID_KEY",
    "REWARD_KEY",
    "SUPPORTED_MODEL_TYPES",
    "Generator",
    "HFGenerator",
    "Rollout",
    "VLLMGenerator",
    "VLLMWeightLoader",
    "WeightsError",
    "check_generate_args",
    "check_named_tensors",
    "hf_parameter_shapes",
    "left_pad",
    "rollout_from_lists",
]
