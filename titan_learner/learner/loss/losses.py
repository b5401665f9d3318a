"""The learner's helpers over TorchRL's GRPO-family losses (the classes: `loss.classes`).

One change of normalization (`TokenMeanKL`) so that every term of the loss is a mean over
trained tokens, the reference KL's estimator, the diagnostics TorchRL's output has no room for
(returned in the forward's output, `LeanForward.forward`), and TorchRL's helpers computed in
fewer operators with the same values. Every loss also takes the row-sum aggregations
(`titan_learner.learner.loss.aggregation`) and `[loss.correction]`
(`titan_learner.learner.loss.correction`).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

import torch
from tensordict import TensorDict

from titan_learner.learner.batch import trained_mask
from titan_learner.learner.forward.logprobs import ChunkedTokenCategorical
from titan_learner.learner.forward.policy import TitanPolicy
from titan_learner.learner.loss.kl_estimators import per_token_kl


def forward_values(loss_module: Any) -> dict[str, Any]:
    """This forward's values: what TorchRL's helpers, which have no channel but `self`, hand
    each other (the trained-token mask and count, the log-weight), and the diagnostics the
    forward returns in its output (`LeanForward.forward`). One dict in the instance's
    __dict__, dropped when the forward returns: never a parameter, buffer or submodule, and
    no `nn.Module.__setattr__`, which looks each name up among them first (~9 us a write)."""
    return vars(loss_module).setdefault("forward_values", {})


class TokenMeanKL:
    """The KL penalties (to the reference, to the inference policy) as token means.

    TorchRL 0.14.1 averages them over every position of the padded `[B, T]` batch, padding
    counted as zero, so their weight depends on how much padding a batch happens to have and a
    split batch (data-parallel ranks, micro-batches) cannot add up to the whole. Rescaled by
    positions / trained tokens they become the mean over the response tokens, like the
    objective: the coefficient means the same on any batch layout.
    """

    def _kl_to_ref(self, tensordict: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        loss, penalty = super()._kl_to_ref(tensordict, *args, **kwargs)  # type: ignore[misc]
        mask = kwargs.get("mask")
        if mask is None:
            return loss, penalty
        positions = tensordict.get("_cur_log_prob").numel()
        scale = positions / mask.sum().clamp_min(1)
        return loss * scale, penalty * scale


class ReferenceKLEstimator:
    """The reference KL's per-token estimate in the loss: `[kl] estimator` (verl's
    `kl_loss_type`), from r = log pi - log pi_ref of each trained token.

    k3 (None, the default) is TorchRL's own term, exp(-r) - 1 + r unclamped, its numbers
    unchanged; k1 = r ("kl") and k2 = r^2 / 2 ("mse") are taken on the same masked log-probs
    and averaged over the same padded positions, which `TokenMeanKL` (outside this class) turns
    into a mean over trained tokens. The gradient flows through log pi only.
    """

    kl_estimator: str | None = None

    def _kl_to_ref(self, tensordict: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.kl_estimator in (None, "k3"):
            return super()._kl_to_ref(tensordict, *args, **kwargs)  # type: ignore[misc]
        coeff = kwargs.get("coeff")
        coeff = self.kl_to_ref_coeff if coeff is None else coeff  # type: ignore[attr-defined]
        # TorchRL's k3 of the same masked log-probs gives them shaped and checked: recover r
        # from its inputs instead of reading the batch a second time
        cur = tensordict.get("_cur_log_prob")
        ref = tensordict.get(
            kwargs.get("key", ("next", "ref_log_probs")),
            as_padded_tensor=True,
            padding_side=self.ref_log_prob_padding_side,  # type: ignore[attr-defined]
            padding_value=self.ref_log_prob_padding_value,  # type: ignore[attr-defined]
        )
        if ref is None:
            return super()._kl_to_ref(tensordict, *args, **kwargs)  # type: ignore[misc]  (its error)
        if ref.ndim == cur.ndim + 1:
            ref = ref.squeeze(-1)
        if ref.shape != cur.shape:
            return super()._kl_to_ref(tensordict, *args, **kwargs)  # type: ignore[misc]  (its error)
        mask = kwargs.get("mask")
        r = cur - ref
        if mask is not None:
            r = torch.where(mask, r, 0.0)
        penalty = per_token_kl(r, self.kl_estimator).mean()
        return coeff * penalty, penalty


class TrainedTokens:
    """The forward's trained-token mask and its count (at least 1), computed once.

    TorchRL's `_log_weight` returns the mask its loss terms are averaged over (response tokens
    with a finite behaviour log-prob); the mixins above read `trained_count` instead of each
    summing that mask again, and `TokenMeanAggregation` selects with `trained_column` and
    divides by it.
    """

    @property
    def trained_mask(self) -> torch.Tensor | None:
        return forward_values(self).get("trained_mask")

    @property
    def trained_column(self) -> torch.Tensor | None:
        """The mask as `[B, T, 1]`, like the loss terms."""
        return forward_values(self).get("trained_column")

    @property
    def trained_count(self) -> torch.Tensor | None:
        return forward_values(self).get("trained_count")

    def _log_weight(self, tensordict: Any, adv_shape: Any) -> tuple[Any, Any, Any, Any]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)  # type: ignore[misc]
        forward_values(self).update(
            trained_mask=mask,
            trained_column=mask.unsqueeze(-1),
            trained_count=mask.sum().clamp_min(1),
        )
        return log_weight, dist, kl_approx, mask


class LogProbMismatch:
    """Measures |learner log-prob - batch log-prob| over the trained tokens at every forward.

    The batch's log-probs are the generator's (the behaviour policy's). Until the step's
    optimizer update the learner holds the very weights that sampled the batch, so in the
    synchronous loop this is the trainer-vs-inference mismatch users ask about: ~1e-7 with the
    embedded generator in fp32, whatever its kernels give with vLLM. The forward returns it as
    `logprob_mismatch` (token mean) and `logprob_mismatch_max` (`LeanForward.forward`).
    """

    def _log_weight(self, tensordict: Any, adv_shape: Any) -> tuple[Any, Any, Any, Any]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)  # type: ignore[misc]
        # The log-weight is exactly 0 off `mask` (TorchRL's `_log_weight` and `MaskedLogWeight`
        # both zero it there): its absolute value is the gap, masked (a boolean index would cost
        # a host sync on GPUs). The sum and the maximum read it in any shape.
        with torch.no_grad():
            gap = log_weight.abs().float()
            if gap.numel():  # gaps are >= 0, so the zeros off the mask leave the max alone
                mismatch = (gap.sum() / self.trained_count, gap.amax())
            else:
                mismatch = (gap.new_zeros(()), gap.new_zeros(()))
            forward_values(self)["logprob_mismatch"] = mismatch
        return log_weight, dist, kl_approx, mask


class MaskedLogWeight:
    """TorchRL's `_log_weight`, the same values in 9 operators instead of 15.

    TorchRL masks the current and the behaviour log-probs apart, each mask expanded, takes
    their difference and the opposite difference (`kl_approx`), and tests finiteness in four
    operators. Here the token mask is `batch.trained_mask` (`|log mu| < inf`, what `isfinite`
    answers; the batch check counts the same mask) and the difference is masked once: on the
    mask both give cur - prev, off it +0.0, so the bits and the gradient are TorchRL's.
    `kl_approx`, which TorchRL's forward only logs, is 0 - log_weight without gradient (the
    exact negation, +0.0 where the weight is 0). The masked current log-prob TorchRL leaves in
    the batch for its KL terms and KL mask is built only when one of them is on. Anything
    unusual (no or a differentiable behaviour log-prob, shapes that differ, a composite
    distribution) takes TorchRL's own path and its errors.
    """

    def _log_weight(self, tensordict: Any, adv_shape: Any) -> tuple[Any, Any, Any, Any]:
        cur, dist, is_composite = self._get_cur_log_prob(tensordict)  # type: ignore[attr-defined]
        prev = tensordict.get(
            self.tensor_keys.sample_log_prob,  # type: ignore[attr-defined]
            None,
            as_padded_tensor=True,
            padding_side="left",
            padding_value=0.0,
        )
        if (
            is_composite
            or not isinstance(cur, torch.Tensor)
            or not isinstance(prev, torch.Tensor)
            or prev.requires_grad
            or cur.shape != prev.shape
            or dist.mask.shape != cur.shape
        ):
            return super()._log_weight(tensordict, adv_shape)  # type: ignore[misc]
        mask = trained_mask(dist.mask, prev)
        log_weight = torch.where(mask, cur - prev, 0.0).unsqueeze(-1)
        kl_approx = torch.rsub(log_weight.detach(), 0.0)
        read = self._reads_cur_log_prob()
        tensordict.set("_cur_log_prob", torch.where(mask, cur, 0.0) if read else cur)
        return log_weight, dist, kl_approx, mask

    def _reads_cur_log_prob(self) -> bool:
        """Whether TorchRL's forward reads the masked current log-prob (KL terms, KL mask)."""
        return bool(
            (self.kl_to_ref_coeff is not None and self.kl_to_ref_coeff > 0)  # type: ignore[attr-defined]
            or self.kl_to_inference_coeff is not None  # type: ignore[attr-defined]
            or (self.kl_mask_threshold is not None and self.kl_mask_threshold > 0)  # type: ignore[attr-defined]
        )


class ChunkedEntropy:
    """The chunked distribution's entropy as it is, without TorchRL's finiteness check.

    TorchRL reads `entropy.isfinite().all()` on the host at every forward and falls back to a
    Monte-Carlo estimate, for dense masked logits whose -inf entries give 0 * -inf.
    `ChunkedTokenCategorical` computes entropies from the finite logits of the scored
    positions only: a non-finite one means non-finite logits, which no estimate repairs (the
    loss is non-finite either way, and the learner drops the step). Other distributions take
    TorchRL's own path.
    """

    def _get_entropy(self, dist: Any, adv_shape: Any) -> Any:
        if isinstance(dist, ChunkedTokenCategorical):
            return dist.entropy().unsqueeze(-1)
        return super()._get_entropy(dist, adv_shape)  # type: ignore[misc]


class CachedClipBounds:
    """TorchRL's clip bounds (log(1 - eps_low), log(1 + eps_high)), computed once per value.

    TorchRL's property runs three operators at every forward. A schedule that writes the two
    buffers in place bumps their version, and a new tensor (`.to()`, an assigning load) has
    another identity: either computes the bounds again.
    """

    _clip_bounds_for: tuple[Any, ...] = ()  # (eps_low, its version, eps_high, its version)
    _clip_bounds_value: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def _clip_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = self.clip_epsilon_low, self.clip_epsilon_high  # type: ignore[attr-defined]
        seen = self._clip_bounds_for
        if not (
            seen
            and seen[0] is low  # the buffers themselves are held, so identity is never reused
            and seen[1] == low._version
            and seen[2] is high
            and seen[3] == high._version
        ):
            self._clip_bounds_value = ((-low).log1p(), high.log1p())
            self._clip_bounds_for = (low, low._version, high, high._version)
        return self._clip_bounds_value


class LeanForward:
    """TorchRL's forward for the learner's own policy, without its per-call plumbing.

    TorchRL 0.14.1's GRPO-family forward copies the batch (each nested TensorDict), looks the
    action key up, enters the exploration and recurrent modes around the call, writes its
    output entry by entry into a TensorDict and converts it: ~0.3 ms a call on a CPU, 2% of
    the 0.08 M step. With `TitanPolicy` as the actor (it neither samples nor recurs, and its
    distributions are plain categoricals) and no KL term or KL mask, this forward calls the
    same helpers (`_log_weight`, `_compute_policy_objective`, `_get_entropy`,
    `_aggregate_loss_value`) in the same order on the same values and returns the same output
    class with the same entries, bit for bit but the `ESS` diagnostic, which is taken without
    TorchRL's host read (`effective_sample_size`): the forward then reads nothing back from
    the device. It reads the batch without copying it; the scratch entry `_cur_log_prob` that
    `_log_weight` leaves there is removed before it returns, as TorchRL removes it from its
    copy. Anything else takes TorchRL's own forward.
    """

    _torchrl_forward: Any = None  # the TorchRL class's own forward (loss.classes sets it)

    def forward(self, tensordict: Any, *, as_dict: bool = False) -> Any:
        """TorchRL's output; `as_dict=True`: its entries as a plain dict instead (what the
        learner edits before it builds its own TensorDict once), with the diagnostics TorchRL's
        output class has no room for: `policy_diagnostics`, the correction's metrics, the
        token means of `TOKEN_DIAGNOSTICS` and `logprob_mismatch` / `logprob_mismatch_max`."""
        vars(self)["forward_values"] = values = {}
        try:
            out = self._lean_terms(tensordict)
            if out is None:
                out = self._torchrl_forward(tensordict)
                if not as_dict:
                    return out
                out = dict(out.items())
            if as_dict:
                self.diagnostics(out, values)
        finally:
            # the distribution and the masks hold the batch's tensors
            vars(self).pop("forward_values", None)
        if as_dict:
            return out
        return self.output_type.from_tensordict(TensorDict(out, batch_size=[]))  # type: ignore[attr-defined]

    def diagnostics(self, out: dict[str, Any], values: dict[str, Any]) -> None:
        """This forward's diagnostics (`values`, see `forward_values`) into `out`."""
        if "weighed" in values:
            self.policy_diagnostics(out, *values["weighed"])
        if values.get("correction_metrics"):
            out.update(values["correction_metrics"])
        token_mean_diagnostics(out, values.get("positions_per_token"))
        if "logprob_mismatch" in values:
            out["logprob_mismatch"], out["logprob_mismatch_max"] = values["logprob_mismatch"]

    def _log_weight(self, tensordict: Any, adv_shape: Any) -> tuple[Any, Any, Any, Any]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)  # type: ignore[misc]
        forward_values(self)["weighed"] = (log_weight, dist, adv_shape)
        return log_weight, dist, kl_approx, mask

    def policy_diagnostics(
        self, out: dict[str, Any], log_weight: Any, dist: Any, adv_shape: Any
    ) -> None:
        """What a GRPO researcher reads first, without gradient, with or without an entropy
        bonus: `entropy`, and which side the ratio was clipped on, `clip_fraction_low` (below
        1 - eps_low) and `clip_fraction_high` (above 1 + eps_high) of the ratio the objective
        clips (a loss's `ratio_log_weight`, else the token's); padded-position means like
        TorchRL's `clip_fraction`, made token means by `token_mean_diagnostics`."""
        with torch.no_grad():
            if "entropy" not in out:
                out["entropy"] = self._get_entropy(dist, adv_shape=adv_shape).mean()  # type: ignore[attr-defined]
            clipped = getattr(self, "ratio_log_weight", None)  # a loss of another ratio (gspo)
            if clipped is not None:
                log_weight = clipped(log_weight)
            low, high = self._clip_bounds  # type: ignore[attr-defined]
            out["clip_fraction_low"] = (log_weight < low).to(log_weight.dtype).mean()
            out["clip_fraction_high"] = (log_weight > high).to(log_weight.dtype).mean()

    def _lean_terms(self, tensordict: Any) -> dict[str, torch.Tensor] | None:
        """The output entries, computed without TorchRL's plumbing; None where it does not
        apply."""
        advantage = self._lean_advantage(tensordict)
        if advantage is None:
            return None
        adv_shape = advantage.shape[:-1]
        try:
            log_weight, dist, kl_approx, mask = self._log_weight(tensordict, adv_shape=adv_shape)  # type: ignore[attr-defined]
        finally:
            tensordict.pop("_cur_log_prob", None)
        if advantage.ndim != log_weight.ndim:
            raise ValueError(
                f"advantage and log_weight must have the same number of dimensions, got "
                f"{advantage.ndim=} and {log_weight.ndim=}"
            )
        objective, clip_fraction = self._compute_policy_objective(log_weight, advantage)  # type: ignore[attr-defined]
        out = {
            "loss_objective": self._aggregate_loss_value(objective, mask, tensordict=tensordict),  # type: ignore[attr-defined]
            "clip_fraction": clip_fraction,
        }
        with torch.no_grad():  # the diagnostics: TorchRL's detached values, without a detach each
            out["kl_approx"] = kl_approx.mean()
            ess = effective_sample_size(log_weight.squeeze(-1), mask, self.trained_count)  # type: ignore[attr-defined]
        if self.entropy_bonus:  # type: ignore[attr-defined]
            entropy = self._get_entropy(dist, adv_shape=adv_shape)  # type: ignore[attr-defined]
            with torch.no_grad():
                out["entropy"] = entropy.mean()
            out["loss_entropy"] = self._aggregate_loss_value(  # type: ignore[attr-defined]
                -self.entropy_coeff * entropy,  # type: ignore[attr-defined]
                mask,
                tensordict=tensordict,
            )
        out["ESS"] = ess
        return out

    def _lean_advantage(self, tensordict: Any) -> torch.Tensor | None:
        """The batch's advantage where this forward applies, else None."""
        if (
            not isinstance(self.actor_network, TitanPolicy)  # type: ignore[attr-defined]
            or self._reads_cur_log_prob()  # type: ignore[attr-defined]  (KL terms, a KL mask)
            or tensordict.get(self.tensor_keys.action, None) is None  # type: ignore[attr-defined]
        ):
            return None
        advantage = tensordict.get(self.tensor_keys.advantage, None)  # type: ignore[attr-defined]
        if not isinstance(advantage, torch.Tensor) or advantage.is_nested:
            return None
        return advantage


def effective_sample_size(
    log_weight: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None
) -> torch.Tensor:
    """TorchRL's `ESS` diagnostic, (sum w)^2 / sum w^2 / trained tokens over the tokens of
    `mask`, without its boolean index (a host read: on a GPU the launch queue runs dry).

    The weights are taken relative to the largest (as a log-sum-exp would), 0 off the mask:
    TorchRL's value up to rounding (a few float32 ulps), in half the time of its two
    log-sum-exps on a CPU. No trained token gives NaN, as TorchRL's does (the weights are then
    NaN, whatever the count). `count`: the mask's count where the caller has it (at least 1).
    """
    if not mask.numel():
        return log_weight.new_full((), math.nan)
    selected = torch.where(mask, log_weight, -math.inf)
    weights = (selected - selected.amax()).exp()
    count = mask.sum() if count is None else count
    # (sum w)^2 / sum w^2 as (sum w / |w|)^2: one reduction fewer
    return (weights.sum() / torch.linalg.vector_norm(weights)).square() / count


TOKEN_DIAGNOSTICS = (
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "kl_approx",
    "entropy",
)


class TokenMeanDiagnostics:
    """`clip_fraction`, `kl_approx` and `entropy` as means over the trained tokens.

    TorchRL 0.14.1 reports them as means over every position of the padded `[B, T]` batch, 0 on
    padding: a batch with more padding reports less clipping and less entropy than its tokens
    have, and a step split over ranks or micro-batches of other widths cannot add up to the
    whole. `positions_per_token` (taken at each forward) rescales them, as `TokenMeanKL` does
    the KL terms, in the forward's output (`token_mean_diagnostics`).
    """

    def _log_weight(self, tensordict: Any, adv_shape: Any) -> tuple[Any, Any, Any, Any]:
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)  # type: ignore[misc]
        forward_values(self)["positions_per_token"] = mask.numel() / self.trained_count
        return log_weight, dist, kl_approx, mask


class TokenMeanAggregation:
    """TorchRL's `token_mean` aggregation of a loss term, in 4 operators instead of 10.

    TorchRL expands the mask twice, selects against a zeros tensor of the term's shape, and sums
    the mask again for each term. Here the term is selected against a scalar under the mask
    broadcast by one dimension (`TrainedTokens.trained_column`, one view for all the terms), and
    divided by `TrainedTokens.trained_count`: the same values in the same order, so the same
    bits. Any other case (another aggregation or reduction, a mask the forward narrowed,
    loss-mask entries in the batch) takes TorchRL's own path.
    """

    def _aggregate_loss_value(
        self, value: torch.Tensor, mask: torch.Tensor, tensordict: Any = None
    ) -> torch.Tensor:
        if (
            self.aggregation != "token_mean"  # type: ignore[attr-defined]
            or self.reduction != "mean"  # type: ignore[attr-defined]
            or mask is not self.trained_mask  # type: ignore[attr-defined]
            or value.ndim != mask.ndim + 1
            or (
                tensordict is not None
                and any(tensordict.get(k, None) is not None for k in self._loss_mask_keys())  # type: ignore[attr-defined]
            )
        ):
            return super()._aggregate_loss_value(value, mask, tensordict=tensordict)  # type: ignore[misc]
        return torch.where(self.trained_column, value, 0.0).sum() / self.trained_count  # type: ignore[attr-defined]


def token_mean_diagnostics(out: MutableMapping[str, Any], scale: torch.Tensor | None) -> None:
    """Rescale the padded-position means of `out` (a loss output as a dict) in place to
    trained-token means (`scale`: the forward's positions per trained token; None: as is)."""
    if scale is None:
        return
    for key in TOKEN_DIAGNOSTICS:
        if key in out:
            out[key] = out[key] * scale
