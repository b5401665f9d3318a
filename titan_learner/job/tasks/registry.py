"""Tasks by name, as a config names them."""

from __future__ import annotations

from titan_learner.job.tasks.base import Task
from titan_learner.job.tasks.sort_digits import SORT_TASK

TASKS: dict[str, Task] = {"sort": SORT_TASK}


def get_task(name: str) -> Task:
    """The task registered as `name`; a ValueError lists the allowed names otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; allowed tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
