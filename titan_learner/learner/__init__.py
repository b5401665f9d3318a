"""The Learner contract (`contract`), its two builds (`local`, `titan`), what the stepper calls
back (`step`), the batch format (`batch`) and its splits (`microbatch`, `reference_scoring`),
over three sub-packages: `forward` (policy, log-probs), `loss` and `optim`."""
