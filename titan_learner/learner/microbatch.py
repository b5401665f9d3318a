"""Token-budget micro-batches: a rank's batch split by length, each trimmed to its longest row.

A GRPO batch mixes short and long sequences, and one left-padded `[B, T]` tensor pays for
`B x T` positions however few are real. With `[learner] max_tokens_per_microbatch = N`, the
learner sorts the rows by real length, packs consecutive rows while `rows x longest row <= N`
(the positions the forward actually computes, so N also bounds activation memory) and cuts
each micro-batch's leading all-padding columns. Padding then only fills the gap between
neighbours in length.

Every data-parallel rank must run the same number of forwards (FSDP gathers parameters in each
one), so the count is the largest any rank needs; a rank that packs into fewer splits its
largest micro-batches in two until it has as many. The loss is still the step's mean over all
of its tokens (titan_learner.learner.loss.normalization), so the split changes nothing but speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from titan_learner.learner.batch import ATTENTION_MASK_KEY, PROMPT_TOKENS_KEY, BatchError


def row_lengths(batch: TensorDictBase) -> torch.Tensor:
    """Real (non-padding) tokens per row, on the CPU."""
    return batch.get(ATTENTION_MASK_KEY).sum(1).cpu()


def pack(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch: longest rows first, `rows x longest <= budget`.

    A row longer than the budget cannot be computed within it: BatchError, before any compute.
    """
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > budget:
        raise BatchError(
            f"a row holds {longest} real tokens, more than max_tokens_per_microbatch = {budget}; "
            "allowed: a budget of at least the longest prompt + completion"
        )
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    groups: list[list[int]] = []
    width = 0
    for row in order:
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
            width = max(int(lengths[row]), 1)
    return [torch.tensor(group) for group in groups]


def split_to(groups: list[torch.Tensor], lengths: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`groups` split until there are `count`: the group with the most positions halves first."""
    groups = list(groups)
    while len(groups) < count:
        cost = [len(g) * int(lengths[g].max()) if len(g) > 1 else -1 for g in groups]
        largest = max(range(len(groups)), key=cost.__getitem__)
        if cost[largest] < 0:
            raise BatchError(
                f"data-parallel ranks must run the same number of micro-batches ({count}, the "
                f"most any rank needs), but this rank has {len(groups)} row(s); allowed: equal "
                "row counts on every rank, or a larger max_tokens_per_microbatch"
            )
        group = groups.pop(largest)
        half = (len(group) + 1) // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups


def take(batch: TensorDictBase, rows: torch.Tensor) -> TensorDictBase:
    """Those rows, without the leading columns that are padding in all of them."""
    micro = batch[rows.to(batch.device)]
    attention = micro.get(ATTENTION_MASK_KEY)
    width = attention.shape[1]
    first = int(attention.any(0).int().argmax())  # the first column with a real token
    if first == 0:
        return micro
    for key in micro.keys(include_nested=True, leaves_only=True):
        value = micro.get(key)
        if value.dim() >= 2 and value.shape[1] == width:
            micro.set(key, value[:, first:])
    return micro


def token_budget_micro_batches(
    batch: TensorDictBase, budget: int, most_over_ranks: Callable[[int], int]
) -> list[TensorDictBase]:
    """The batch as micro-batches of at most `budget` computed positions each, as many as
    `most_over_ranks(count)` says the rank that needs the most has (a collective)."""
    if PROMPT_TOKENS_KEY in batch.keys(include_nested=True):
        raise BatchError(
            f"{PROMPT_TOKENS_KEY!r} is not supported with max_tokens_per_microbatch: its width "
            "would no longer match the trimmed rows; allowed: batches without it"
        )
    lengths = row_lengths(batch)
    groups = pack(lengths, budget)
    groups = split_to(groups, lengths, most_over_ranks(len(groups)))
    return [take(batch, rows) for rows in groups]
