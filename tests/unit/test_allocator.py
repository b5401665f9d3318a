"""glibc told to keep freed memory (titan_learner.allocator; the job sets it at start).

Its effect is a speed one (a step reuses the pages the last one touched instead of faulting in
fresh mappings: the embedded default's update 0.25 -> 0.18 s a step), measured by
benchmarks/bench_job.py, not here: glibc's own thresholds move with each process's allocation
history, so a page-fault count in a test would be flaky, not a check.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from titan_learner import allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_glibc_takes_the_thresholds():
    """In a fresh process, so that this one's allocator keeps its defaults."""
    code = "from titan_learner.allocator import keep_freed_memory as k; print(k(), k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_elsewhere_it_does_nothing(monkeypatch):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False
