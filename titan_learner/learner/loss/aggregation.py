"""The row-sum aggregations TorchRL 0.14.1 does not have: `seq_mean_token_sum` and
`seq_mean_token_sum_norm` (verl's "seq-mean-token-sum" and "seq-mean-token-sum-norm").

TorchRL's `_aggregate_loss_value` knows `token_mean`, `prompt_mean` and `none`, and takes any
other name for `token_mean` without a word, so these two are computed here:

- `seq_mean_token_sum`: the mean over rows of each row's sum over its trained tokens;
- `seq_mean_token_sum_norm`: the sum over the trained tokens divided by rows x
  `max_new_tokens` ([rollout] max_new_tokens), a constant per row: Dr. GRPO's normalizer
  (Liu et al., 2025, "Understanding R1-Zero-Like Training"), which neither favours short
  correct answers nor long wrong ones as a per-row length division does.

Both are means over rows, so the learner's normalization across micro-batches and
data-parallel ranks counts rows for them (`normalization.AGGREGATION_COUNTS`), as for
`prompt_mean`: the step's loss is the formula over all of its rows, however it is split.
"""

from __future__ import annotations

from typing import Any

import torch

ROW_SUMS = ("seq_mean_token_sum", "seq_mean_token_sum_norm")


class RowSumAggregation:
    """`aggregation = "seq_mean_token_sum"` or `"seq_mean_token_sum_norm"` of a loss term
    `[B, T, 1]` over the trained-token mask `[B, T]`; any other aggregation is the next
    class's. `max_new_tokens` is the `_norm` form's constant (set by `classes.build_loss`)."""

    max_new_tokens: int | None = None

    def _aggregate_loss_value(
        self, value: torch.Tensor, mask: torch.Tensor, tensordict: Any = None
    ) -> torch.Tensor:
        aggregation = self.aggregation  # type: ignore[attr-defined]
        if aggregation not in ROW_SUMS or self.reduction != "mean":  # type: ignore[attr-defined]
            return super()._aggregate_loss_value(value, mask, tensordict=tensordict)  # type: ignore[misc]
        row_sums = torch.where(mask.unsqueeze(-1), value, 0.0).sum(dim=(-2, -1))
        if aggregation == "seq_mean_token_sum":
            return row_sums.mean()
        if not self.max_new_tokens:
            raise ValueError(
                "aggregation 'seq_mean_token_sum_norm' divides by rows x max_new_tokens; set "
                "the loss module's max_new_tokens (build_loss sets [rollout] max_new_tokens)"
            )
        return row_sums.sum() / (row_sums.numel() * self.max_new_tokens)
