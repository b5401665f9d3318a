"""A frozen reference model for the optional KL penalty of GRPO-family losses.

With `[loss] kl_to_ref_coeff` set, TorchRL's `GRPOLoss` reads `("next", "ref_log_probs", "full")`
from the batch: float `[B, T]` log-probs of `("tokens", "full")` under the reference policy, in
the batch's own left-padded layout. The loss then keeps only the positions of its token mask (the
response mask and finite behaviour log-probs, under the default "rlhf" masking) and sets every
other position to 0 on both sides before the KL, so off-mask values never count; a ragged input
would be padded with `ref_log_prob_padding_value` (0.0 by default).

`ReferenceModel` is the policy's starting point, frozen: built by `build_model(config)`
from the same config as the learner (same initial weights, same TorchTitan sharding), parameters
without gradients, eval mode, no optimizer. A LoRA policy's starting point is its frozen base:
its reference is the learner's own model with the adapters switched off (`base_of`).
`log_probs` scores the positions its caller reads (`kl_log_probs`: the response under the
default "rlhf" masking; every real token under the other strategies) and writes 0.0 elsewhere. Scoring only the response lets `[learner]
share_prompts` run each group's prompt once in the reference's forward too, as in the
learner's. The first real token of a row has no predecessor and scores -log(V) (a uniform
distribution), as in the policy's own shifted convention.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_learner.config.loss_values import PROJECT_DEFAULTS
from titan_learner.dtypes import DTYPES
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, ATTENTION_MASK_KEY, TOKENS_KEY
from titan_learner.learner.forward.policy import TitanPolicy
from titan_learner.model.build import build_model
from titan_learner.model.lora import adapters_off

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims

    from titan_learner.config.schema import Config


class ReferenceModel:
    """The frozen reference policy, built and sharded like the learner's model.

    Build it after the learner (it joins the same default process group, on every rank).
    `log_probs` is a collective (the sharded forward gathers FSDP shards and runs tensor-parallel
    collectives): every rank must call it, the same number of times and in the same order, and
    ranks of one tensor-parallel group must pass the same batch.
    """

    def __init__(
        self, config: Config, dims: ParallelDims | None = None, initial_weights: bool = True
    ) -> None:
        """`dims`: the learner's mesh (`TitanLearner.parallel_dims`), to share its groups.
        initial_weights=False: weights to be copied in by the caller (not the policy's start)."""
        # Materializing the model draws from the global RNG: keep the learner's stream as it was.
        cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            built = build_model(config, dims=dims, initial_weights=initial_weights)
        model = built.model.requires_grad_(False).eval()
        if isinstance(model, FSDPModule):  # see `_reshard`
            model.set_reshard_after_forward(True)
        self._setup(config, model, built.device, nullcontext)

    @classmethod
    def base_of(cls, config: Config, model: nn.Module, device: torch.device) -> ReferenceModel:
        """A LoRA policy's reference: its own `model` with the adapters switched off
        (model.lora.adapters_off), which is the frozen base, exactly; no second copy."""
        reference = cls.__new__(cls)
        reference._setup(config, model, device, partial(adapters_off, model))
        return reference

    def _setup(
        self,
        config: Config,
        model: nn.Module,
        device: torch.device,
        base: Callable[[], AbstractContextManager],
    ) -> None:
        self.model = model
        self.device = device
        self._base = base  # the context the reference's forward runs in
        learner = config.learner
        self.policy = TitanPolicy(
            self.model,
            logprob_chunk_size=learner.logprob_chunk_size,
            compute_entropy=False,
            share_prompts=learner.share_prompts,
        )
        self._masking = {**PROJECT_DEFAULTS, **config.loss.kwargs}.get("masking_strategy")
        # The learner's loss runs under this autocast: score the reference the same way.
        self._autocast = {
            "device_type": self.device.type,
            "dtype": DTYPES[learner.autocast_dtype],
            "enabled": learner.mixed_precision,
        }

    @torch.no_grad()
    def log_probs(self, batch: TensorDictBase, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 `[B, T]` reference log-probs of the batch's tokens where `mask` is True
        (every real token without one); 0.0 elsewhere and on padding.

        A collective: every rank calls it (see the class docstring).
        """
        tokens = batch.get(TOKENS_KEY).to(self.device)
        attention = batch.get(ATTENTION_MASK_KEY).to(self.device)
        scored_at = attention if mask is None else attention & mask.to(self.device)
        with torch.autocast(**self._autocast), self._base():
            if self.policy.logprob_chunk_size:  # no [B, T, V] logits; 0 off the mask
                scored = self.policy.token_dist(tokens, attention, scored_at).log_prob(tokens)
                self._reshard()
                return scored
            logits = self.policy.token_logits(tokens, attention)
        self._reshard()
        targets = torch.where(attention, tokens, 0).unsqueeze(-1)  # padding ids may be anything
        scored = logits.log_softmax(-1).gather(-1, targets).squeeze(-1)
        return torch.where(scored_at, scored, 0.0)

    def kl_log_probs(self, batch: TensorDictBase) -> torch.Tensor:
        """`log_probs` where TorchRL's KL to the reference reads them: its token mask keeps the
        response (the assistant mask, under the default "rlhf" masking) and zeroes every other
        position on both sides; every real token under the other masking strategies."""
        rlhf = self._masking == "rlhf"
        return self.log_probs(batch, batch.get(ASSISTANT_MASK_KEY) if rlhf else None)

    def _reshard(self) -> None:
        """Free the gathered weights: a forward without backward leaves FSDP groups unsharded
        (TorchTitan's last group, which does not reshard after forward, and the lm_head the
        chunked path calls after the decoder's forward) until asked, a full lm_head per rank.
        With reshard after forward set on every group, `reshard()` may release them."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
