"""DataError: a data or tokenizer problem, named by file, line or row, and what is allowed."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data: what is wrong, where (file and line or row), and what is allowed."""
