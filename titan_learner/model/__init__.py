"""The model: TorchTitan spec, one build path (plain or sharded), sharding plan, initial weights,
the matching transformers config, and the accommodations TorchTitan needs on CPU/gloo."""
