"""Verifiable synthetic tasks for the embedded default, with their built-in vocabulary."""

from titan_learner.job.tasks.base import Task
from titan_learner.job.tasks.registry import TASKS, get_task

__all__ = ["TASKS", "Task", "get_task"]
