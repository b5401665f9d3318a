"""Rewards of the GRPO job: built-ins (`builtins`), user functions (`loading`), and the runner
that sums them with weights, times them out and reports errors with the row (`runner`)."""
