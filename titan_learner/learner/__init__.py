"""The Learner contract (`contract`), its two builds (`local`, `titan`), and what it is made of:
the batch format, the TorchRL policy and loss, log-probs, optimizer, stepper and guards."""
