"""What a log handler with one of our filters writes (the filters vLLM's handlers get from the
plugin: titan_learner.vllm.refusals, titan_learner.vllm.reload_log)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable


def written_through(log_filter: logging.Filter, emit: Callable[[logging.Logger], None]) -> str:
    """The text a handler carrying `log_filter` writes for what `emit` logs on a fresh logger."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(log_filter)
    logger = logging.getLogger(f"test-log-filter-{id(stream)}")
    logger.addHandler(handler)
    logger.propagate = False
    emit(logger)
    return stream.getvalue()
