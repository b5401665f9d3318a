"""Multi-process gloo worlds and whole-job runs (mostly marked slow)."""
