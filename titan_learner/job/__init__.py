"""The GRPO job: the loop (`grpo`), its checks (`checks`), evaluation, group advantages, the
frozen reference model, telemetry and the job's collectives."""
