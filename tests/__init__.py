"""The test suite: `unit/` (one process), `integration/` (spawned gloo worlds, whole jobs),
`support/` (helpers they share: tiny configs and batches, worlds, scenarios run inside worlds)."""
