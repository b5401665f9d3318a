"""The trainer-vs-generator log-prob mismatch on stale steps (`[rollout] max_off_policy_steps`).

`training/logprob_mismatch` compares, over the sampled tokens, the generator's log-probs with
the learner's for the same weights. On an on-policy step the learner's own forward gives it
(losses.LogProbMismatch). On a stale step the learner has moved on by the time it trains the
batch, so `BehaviourScorer` keeps the weights of each version a coming step will train on
stale (a frozen model sharded like the learner's, as the KL reference is, plus a copy per
further version in flight: k - 1 for k steps off-policy) and scores the batch under them
before the update: one forward without gradient per stale step. Copies are of each rank's
own shards, without collectives; the forward is a collective like the learner's.

The rollouts a preempted run saved were sampled from versions older than its checkpoint,
whose weights are gone: their steps report no mismatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDictBase

from titan_learner.job.reference import ReferenceModel
from titan_learner.learner.batch import ATTENTION_MASK_KEY, LOG_PROBS_KEY
from titan_learner.learner.loss.normalization import sums_and_maxima_over
from titan_learner.rollout.pipeline import stale_versions_after

if TYPE_CHECKING:
    from titan_learner.config.schema import Config


class BehaviourScorer:
    """Keeps the weights versions stale steps will need; scores a stale batch under its own.

    `before_update(step, batch, version)` is called on every rank at every step, before the
    update of `step` (the learner then holds version step - 1).
    """

    def __init__(
        self, config: Config, learner, is_sync_point: Callable[[int], bool], start: int
    ) -> None:
        self.learner = learner
        # The learner's weights are copied in before any scoring: no initial state to read.
        self.frozen = ReferenceModel(config, learner.parallel_dims, initial_weights=False)
        self._k = config.rollout.max_off_policy_steps
        self._start, self._last = start, config.run.steps
        self._is_sync_point = is_sync_point
        self._held: int | None = None  # the version the frozen model holds
        self._kept: dict[int, list[torch.Tensor]] = {}  # further versions, as shard copies

    def before_update(self, step: int, batch: TensorDictBase, version: int) -> dict[str, float]:
        """The mismatch of a stale batch (empty when on-policy or the weights are gone), then
        keep the learner's weights if a coming stale step needs them."""
        metrics = {}
        if version < step - 1 and self._hold(version):
            metrics = self._mismatch(batch)
        needed = stale_versions_after(step, self._k, self._start, self._is_sync_point, self._last)
        self._kept = {v: shards for v, shards in self._kept.items() if v in needed}
        if self._held not in needed:
            self._held = None
        if step - 1 in needed:
            self._keep(step - 1)
        return metrics

    def _params(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The parameters, sharded (as both models are between steps: the learner's after its
        backward, the frozen one's after `log_probs`), so copies are of each rank's shards."""
        return [p.detach() for p in model.parameters()]

    @torch.no_grad()
    def _keep(self, version: int) -> None:
        current = self._params(self.learner.model)
        if self._held is None:
            for mine, theirs in zip(self._params(self.frozen.model), current, strict=True):
                mine.copy_(theirs)
            self._held = version
        else:
            self._kept[version] = [p.clone() for p in current]

    @torch.no_grad()
    def _hold(self, version: int) -> bool:
        """Put `version` into the frozen model; False if no copy of it was kept."""
        if self._held == version:
            return True
        shards = self._kept.pop(version, None)
        if shards is None:
            return False
        frozen = self._params(self.frozen.model)
        if self._held is not None:  # a later step may need it: kept until it is not
            self._kept[self._held] = [p.clone() for p in frozen]
        for mine, kept in zip(frozen, shards, strict=True):
            mine.copy_(kept)
        self._held = version
        return True

    def _mismatch(self, batch: TensorDictBase) -> dict[str, float]:
        """|generator - learner| log-prob over the sampled tokens, over all data-parallel ranks."""
        device = self.frozen.device
        behaviour = batch.get(LOG_PROBS_KEY).to(device)
        sampled = torch.isfinite(behaviour) & batch.get(ATTENTION_MASK_KEY).to(device)
        scored = self.frozen.log_probs(batch, sampled)  # prompts once each, sharing them
        gap = (scored - behaviour)[sampled].abs().double()
        sums, maxima = sums_and_maxima_over(
            self.learner.data_parallel_group,
            device,
            {"gap": float(gap.sum()), "tokens": float(gap.numel())},
            {"gap": float(gap.max()) if gap.numel() else 0.0},
        )
        return {
            "logprob_mismatch": sums["gap"] / max(sums["tokens"], 1.0),
            "logprob_mismatch_max": maxima["gap"],
        }
