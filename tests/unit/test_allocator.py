"""With glibc told to keep freed memory, a training step reuses the pages the last one touched
instead of faulting in fresh mappings (titan_learner.allocator; the job sets it at start)."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEPS = """
import resource, sys, torch
from titan_learner.allocator import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256))
x = torch.randn(2048, 256)
def step():
    model(x).square().mean().backward()
for _ in range(3):
    step()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = faults()
for _ in range(10):
    step()
print(faults() - before)
"""


def page_faults(mode: str) -> int:
    """Minor page faults of ten steps after three, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_spares_a_step_the_page_faults_of_fresh_mappings():
    default, kept = page_faults("default"), page_faults("kept")
    assert kept * 3 < default, (kept, default)
