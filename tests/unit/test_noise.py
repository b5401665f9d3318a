"""Only the dependency messages a user cannot act on are dropped (titan_learner.noise)."""

from __future__ import annotations

import logging

import titan_learner  # noqa: F401  # installs the filters, as any use of the package does


def test_the_dropped_messages_and_nothing_else(caplog):
    caplog.set_level(logging.INFO)
    root, vllm = logging.getLogger(), logging.getLogger("vllm.triton_utils.importing")
    root.warning(  # TorchTitan's init_distributed under torchrun, as it words it
        "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config"
    )
    vllm.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    root.warning("ENV[TORCH_FR_BUFFER_SIZE] = 7 will be overridden to 0 based on job config")
    vllm.warning("Triton is not installed")
    assert [r.getMessage() for r in caplog.records] == [
        "ENV[TORCH_FR_BUFFER_SIZE] = 7 will be overridden to 0 based on job config",
        "Triton is not installed",
    ]
