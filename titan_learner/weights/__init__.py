"""Weights out of the learner: the streamed Hugging Face-named export (`export`), the one check
that named tensors fit a receiver (`matching`), and the sinks (`sinks`; vLLM's sinks live in
titan_learner.vllm, which builds on these)."""
