"""A weight update the workers refuse is one line in a server's log, in each of the three forms
vLLM's processes log it (worker, engine core, API server); any other error keeps its
traceback."""

from __future__ import annotations

import logging

from tests.support.logs import written_through
from titan_learner.vllm.refusals import REFUSED, OneLineRefusal

REFUSAL = f"{REFUSED}refused export v11: checksum mismatch (bucket 0)"


def logged(error: BaseException, message: str) -> str:
    def emit(logger: logging.Logger) -> None:
        try:
            raise error
        except BaseException:
            logger.exception(message, "update_weights")

    return written_through(OneLineRefusal(), emit)


def test_each_process_logs_the_refusal_in_one_line():
    for error in (
        ValueError(REFUSAL),  # the worker's own (a WeightsError is a ValueError)
        RuntimeError(f"Worker failed with error '{REFUSAL}', please check the stack trace above"),
        Exception(f"Call to update_weights method failed: {REFUSAL}"),  # the API server's
    ):
        assert logged(error, "Invocation of %s method failed") == REFUSAL + "\n"


def test_other_errors_keep_their_traceback():
    text = logged(RuntimeError("engine died"), "Invocation of %s method failed")
    assert text.startswith("Invocation of update_weights method failed\nTraceback")
    assert "RuntimeError: engine died" in text
