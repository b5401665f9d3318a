"""The forward: the TorchRL LLM actor over the TorchTitan model (`policy`), chunked log-probs
and entropies (`logprobs`, `justified_stats`) and shared prompts (`shared_prompts`)."""
