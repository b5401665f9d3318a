"""The optimizer side: TorchTitan's optimizer and schedule (`optimizer`, `local_shard_adam`),
TorchRL's stepper with deferred gradient sync (`stepper`), gradient clipping on local shards
(`clipping`) and the contract's guards (optimizer coverage, loss-owned state)."""
