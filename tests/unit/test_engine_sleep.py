"""An engine's sleep mode (titan_learner.vllm.engine_sleep) around a recording `vllm.LLM`: it
wakes only what sleeps, and the learner's cached CUDA memory is released before each wake.

vLLM's sleep mode is CUDA's: the real engine's memory is checked on a GPU
(tests/integration/test_vllm_engine.py); here torch's CUDA calls are stood in for.
"""

from __future__ import annotations

import torch

from titan_learner.vllm.engine_sleep import EngineSleep


class RecordingLLM:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tags))


def test_the_learners_cached_memory_goes_back_before_each_wake_on_its_device(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    device = torch.device("cuda", 3)
    engine = EngineSleep(RecordingLLM(calls), 1, device)
    engine.sleep()
    engine.wake("weights")
    engine.wake("weights", "kv_cache")
    engine.wake("weights", "kv_cache")  # awake: nothing to release
    assert calls == [
        ("sleep", 1),
        ("sync", device),
        ("empty_cache",),
        ("wake_up", ["weights"]),
        ("sync", device),
        ("empty_cache",),
        ("wake_up", ["kv_cache"]),
    ]


def test_a_process_that_never_used_cuda_wakes_its_engine_without_touching_cuda(monkeypatch):
    def no_cuda(*_):
        raise AssertionError("a CUDA call in a process that holds no CUDA memory")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", no_cuda)
    calls: list = []
    engine = EngineSleep(RecordingLLM(calls), 1)
    engine.sleep()
    engine.wake("weights", "kv_cache")
    assert calls == [("sleep", 1), ("wake_up", ["weights", "kv_cache"])]
