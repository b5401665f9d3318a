"""Schulman's per-token estimators of KL(pi || pi_ref), from r = log pi(a) - log pi_ref(a) of
each sampled token a (verl's `kl_penalty` / `kl_loss_type` names in brackets):

    k1 = r                      ("kl")
    k2 = r^2 / 2                ("mse")
    k3 = exp(-r) - 1 + r        ("low_var_kl")

One definition for the KL in the loss (`learner.loss.losses.ReferenceKLEstimator`) and in the reward
(`job.kl_reward`, which clamps k3 as verl does).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def per_token_kl(r: torch.Tensor, estimator: str) -> torch.Tensor:
    """Each token's estimate of KL(pi || pi_ref) from its log-ratio `r`."""
    if estimator == "k1":
        return r
    if estimator == "k2":
        return 0.5 * r.square()
    if estimator == "k3":
        return torch.expm1(-r) + r
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")
