"""vLLM's reload warns that the rotary embedding "failed to load weights" on every update (its
cos/sin cache is in no checkpoint): that warning is dropped, the same one for any other layer
is kept (the servers' own logs: tests/integration/test_toy_servers.py)."""

from __future__ import annotations

from tests.support.logs import written_through
from titan_learner.vllm.reload_log import NoRotaryReloadWarning


def logged(layer: str) -> str:
    """What a handler with the filter writes for vLLM's warning (`reload.layerwise`'s call)."""
    return written_through(
        NoRotaryReloadWarning(), lambda logger: logger.warning("%s: Failed to load weights", layer)
    )


def test_the_rotary_embeddings_warning_is_dropped_and_any_other_layers_kept():
    assert logged("Llama3RotaryEmbedding") == ""
    assert logged("RotaryEmbedding") == ""
    assert logged("QKVParallelLinear") == "QKVParallelLinear: Failed to load weights\n"
    assert logged("RotaryEmbeddingButNot x") != ""
