"""A TorchRL LLM actor over a TorchTitan decoder, so torchrl.objectives.llm losses run on it.

TorchRL's LLM losses ask the actor for a masked categorical over a left-padded `[B, T]` batch,
with the shifted convention: `logits[:, t]` scores token t and position 0 is zeros. A causal model
must not attend to left padding, and TorchTitan's SDPA path is causal-only (no padding mask), so
each row is left-justified before the forward (real tokens first, positions 0..n-1) and the
logits are put back in the caller's layout afterwards. Padding then only ever follows real tokens,
which causal attention never looks at: log-probs equal those of the unpadded sequence.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from torch import nn
from torch.distributed.tensor import DTensor
from torchrl.modules.llm.policies.common import LLMWrapperBase

from titan_learner.model import uses_flex_attention

TOKENS_KEY = ("tokens", "full")
ATTENTION_MASK_KEY = ("masks", "all_attention_mask")
ASSISTANT_MASK_KEY = ("masks", "all_assistant_mask")


def left_justify_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row permutation that puts real tokens first, in order: gather with it to justify."""
    return torch.argsort((~attention_mask).to(torch.int8), dim=1, stable=True)


class TitanPolicy(LLMWrapperBase):
    """Log-prob (non-generating) actor over a TorchTitan model; the model may be sharded."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.generate = False
        self.pad_output = True
        self.input_mode = "tokens"
        self.tokenizer = None
        self.in_keys = [TOKENS_KEY, ATTENTION_MASK_KEY]
        self.out_keys = ["logits"]

    def token_logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Shifted float32 logits `[B, T, V]` in the caller's (left-padded) layout."""
        order = left_justify_order(attention_mask)
        justified = tokens.gather(1, order)
        masks = None
        if uses_flex_attention(self.model):
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            masks = self.model.get_attention_masks(positions)
        out = self.model(justified, attention_masks=masks)
        if isinstance(out, DTensor):  # tensor-parallel lm_head with loss parallel
            out = out.full_tensor()
        out = out.float()
        shifted = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        inverse = torch.argsort(order, dim=1)
        return shifted.gather(1, inverse.unsqueeze(-1).expand_as(shifted))

    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        tensordict_out: TensorDictBase | None = None,
        logits_only: bool = False,
        **kwargs,
    ) -> TensorDictBase:
        out = tensordict if tensordict_out is None else tensordict_out
        logits = self.token_logits(tensordict.get(TOKENS_KEY), tensordict.get(ATTENTION_MASK_KEY))
        out.set("logits", logits)
        return out
