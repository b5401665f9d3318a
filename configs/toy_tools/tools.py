"""The multi-turn default's tool: sensors whose readings change from one call to the next, so
that only a call made in the episode can tell the current reading (none can be memorized)."""

from __future__ import annotations

import random

SENSORS = "abcdefghij"
_READINGS = random.Random(37)
"""One seeded stream for every call: a run's readings repeat when its calls come in the same
order (the config answers calls on one thread). It is this process's state, not the job's: a
resumed run starts it afresh, so its readings part from the uninterrupted run's."""


def lookup(key: str) -> str:
    """The current reading of a sensor, a digit; each call reads it anew.

    key: the sensor, one letter from a to j
    """
    if key not in SENSORS or len(key) != 1:
        raise ValueError(f"no sensor {key!r}; sensors: one letter from a to j")
    return str(_READINGS.randrange(10))
