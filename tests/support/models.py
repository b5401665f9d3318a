"""Shared test fixtures in plain functions: the tiny model config and the synthetic batches."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from titan_learner.config.schema import Config
from titan_learner.config.toml import config_from_dict
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    LOG_PROBS_KEY,
    REF_LOG_PROBS_KEY,
    grouped_synthetic_batch,
    synthetic_batch,
)

VOCAB = 32
SEQ_LEN = 16
GLOBAL_BATCH = 8
GROUP = 4  # rows per prompt in grouped batches: two groups per global batch


def tiny_config(name: str = "llama3", **sections: dict) -> Config:
    """A 2-layer, dim-64 model with GQA (4 heads, 2 KV heads), so tp=2 divides everything."""
    overrides = {
        "vocab_size": VOCAB,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "hidden_dim": 128,
    }
    if name == "qwen3":
        overrides["head_dim"] = 16
    data = {
        "model": {"name": name, "overrides": overrides},
        "optimizer": {"lr": 1e-3},
        "run": {"seed": 0},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data, source="tests")


def batches(
    steps: int,
    batch_size: int = GLOBAL_BATCH,
    seed: int = 0,
    varied: bool = False,
    grouped: bool = False,
):
    """`steps` synthetic GRPO batches; varied=True: rows train different numbers of tokens;
    grouped=True: as a rollout makes them, groups of GROUP consecutive rows sharing a prompt
    (of its own length), each row with its own response length."""
    generator = torch.Generator().manual_seed(seed)
    if grouped:
        return [
            grouped_synthetic_batch(batch_size // GROUP, GROUP, SEQ_LEN, VOCAB, generator)
            for _ in range(steps)
        ]
    return [
        synthetic_batch(batch_size, SEQ_LEN, VOCAB, generator, varied=varied) for _ in range(steps)
    ]


def with_ref_log_probs(batch: TensorDict) -> TensorDict:
    """The batch with reference log-probs for a KL-to-reference loss (a fixed function of it)."""
    out = batch.clone()
    assistant = batch.get(ASSISTANT_MASK_KEY)
    out.set(REF_LOG_PROBS_KEY, torch.where(assistant, batch.get(LOG_PROBS_KEY) * 0.9 - 0.05, 0.0))
    return out


def loss_outputs_and_grads(learner, batch) -> tuple[dict, list]:
    """The learner's loss module on a checked `batch`: every output entry (detached) and the
    gradients of its summed loss terms (the model's parameters that got one, in order)."""
    out = learner.loss_module(batch)
    values = {k: out.get(k) for k in out.keys()}
    learner.model.zero_grad(set_to_none=True)
    sum(v for k, v in values.items() if k.startswith("loss")).backward()
    grads = [p.grad.clone() for p in learner.model.parameters() if p.grad is not None]
    return {k: v.detach() for k, v in values.items()}, grads


def policy_distribution(learner, batch, mask, chunk_size: int, compute_entropy: bool = True):
    """The learner's policy's distribution over `mask`'s positions with `logprob_chunk_size`
    set to `chunk_size` (0: TorchRL's dense one) and `compute_entropy`, both restored after."""
    policy = learner.policy
    saved = policy.logprob_chunk_size, policy.compute_entropy
    policy.logprob_chunk_size, policy.compute_entropy = chunk_size, compute_entropy
    try:
        return policy._get_dist_with_custom_mask(batch, mask)
    finally:
        policy.logprob_chunk_size, policy.compute_entropy = saved


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(7))


def learner_logits(learner, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return learner.model(x.to(learner.device)).float().cpu()


def hf_model(learner, seed: int = 123) -> torch.nn.Module:
    """A transformers model of the learner's architecture with other (seeded) weights."""
    from transformers import AutoModelForCausalLM

    from titan_learner.model.hf_config import hf_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config(learner.spec), dtype=torch.float32).eval()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}
