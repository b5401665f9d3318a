"""Verifiable synthetic tasks for the embedded default, with their built-in vocabulary."""

from titan_learner.tasks.base import Task
from titan_learner.tasks.registry import TASKS, get_task

__all__ = ["TASKS", "Task", "get_task"]
