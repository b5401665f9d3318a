"""vLLM's in-place reload warns "<layer>: Failed to load weights" on every weight update for the
rotary embedding: its cos/sin cache is a buffer vLLM counts as loadable, and no checkpoint,
so no update, carries it (`reload.layerwise`). The reload then puts the layer's own cache
back, which is right. One such warning per update reads as a failing update in every
server's log, so `quiet_rotary_reload`, installed by the plugin in every vLLM process, drops
it; the same warning for any other layer stays.
"""

from __future__ import annotations

import logging
import re

ROTARY_RELOAD = re.compile(r"\w*RotaryEmbedding: Failed to load weights")
"""The message vLLM logs for a rotary embedding (`RotaryEmbedding`, `Llama3RotaryEmbedding`, ...)."""


class NoRotaryReloadWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return ROTARY_RELOAD.fullmatch(record.getMessage()) is None


def quiet_rotary_reload() -> None:
    """On vLLM's log handlers (every vLLM logger writes through them); idempotent."""
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, NoRotaryReloadWarning) for f in handler.filters):
            handler.addFilter(NoRotaryReloadWarning())
