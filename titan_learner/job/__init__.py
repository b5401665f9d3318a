"""The GRPO job: the loop (`grpo`), group advantages, the frozen reference model, telemetry and
the built-in tasks."""
