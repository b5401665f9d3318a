"""One-process tests: config, CLI, batch format, learner contract, weights and sinks, generators."""
