"""One call bounded in time, for tools and environment steps run in the rollout's process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CallTimeout(TimeoutError):
    """The call overran its limit; it was abandoned, not stopped (a thread cannot be)."""


def call_with_timeout(
    function: Callable[..., Any], args: tuple, kwargs: dict, seconds: float
) -> Any:
    """`function(*args, **kwargs)` in a daemon thread: its result or its exception, or
    CallTimeout after `seconds`. Daemon, so a hung call never holds the process at exit."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as err:  # handed to the caller, who decides
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True, name="titan-learner-env-call")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise CallTimeout(f"did not return within {seconds:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
