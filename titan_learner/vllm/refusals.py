"""A weight update a server's workers refuse is one line in the server's log.

The refusal travels up three of vLLM's processes, and each logs it with a traceback: the
worker ("WorkerProc hit an exception."), the engine core ("Invocation of update_weights method
failed") and the API server (uvicorn's "Exception in ASGI application"), ~120 lines for one
tampered bucket. The refusal itself is expected operation (the served weights are untouched,
the trainer reports it), so `quiet_refusals`, installed by the plugin in every vLLM process,
turns each of those records into one line: the refusal. Any other exception keeps its
traceback.
"""

from __future__ import annotations

import logging

REFUSED = "weight update refused, nothing was swapped: "
"""Starts the message of every update the gloo workers refuse; found in any process's copy."""


class OneLineRefusal(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = str(error) if error is not None else ""
        if REFUSED in message:
            record.msg, record.args = "%s", (_refusal(message),)
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def _refusal(message: str) -> str:
    """The refusal in `message`: to the end of its line, or of the quotes vLLM put it in."""
    start = message.index(REFUSED)
    line = message[start:].splitlines()[0]
    quote = message[start - 1] if start else ""
    return line[: line.find(quote)] if quote in ("'", '"') and quote in line else line


def quiet_refusals() -> None:
    """On vLLM's log handlers (every vLLM logger writes through them) and on uvicorn's error
    logger (its own records); idempotent."""
    for target in (*logging.getLogger("vllm").handlers, logging.getLogger("uvicorn.error")):
        if not any(isinstance(f, OneLineRefusal) for f in target.filters):
            target.addFilter(OneLineRefusal())
