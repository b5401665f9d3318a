"""The errors of checkpoint save and load: each names the operation, the path and the cause."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read: what is wrong, where, and what is allowed."""


class CheckpointTimeoutError(CheckpointError):
    """A collective checkpoint operation that not every rank joined within the timeout."""
