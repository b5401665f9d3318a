"""The loss: the `[loss]` TorchRL class built over the policy (`losses`), the published
objectives TorchRL lacks or departs from (`cispo`, `gspo`), behaviour correction, row-sum
aggregations, the KL estimators, and the step's token-mean normalization."""
