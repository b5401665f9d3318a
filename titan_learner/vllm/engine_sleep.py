"""vLLM's sleep mode for an engine that shares its GPU with the learner.

Awake, a colocated engine holds `gpu_memory_utilization` of the GPU (its weights and KV cache)
for the whole run. Asleep at level 1, its weights wait in host memory and its KV cache is
dropped, so the learner's update has the GPU to itself. The generator sleeps after each rollout
and wakes in two steps, the order verl's and TRL's colocated engines use: the weights before an
update is written into them, the KV cache before the next rollout.

Before each wake the learner's CUDA caching allocator gives back what it holds unused
(`release_cached_memory`).

Level 2 (weights dropped too, cheaper when every rollout follows an update) is not offered:
an evaluation or a resumed run's first rollout samples without an update before it.
"""

from __future__ import annotations

from typing import Any

import torch

SLEEP_LEVELS = (0, 1)
"""[rollout.vllm] sleep_level: 0 never sleeps; 1 sleeps between rollouts."""


def default_sleep_level(*, colocated_on_gpu: bool, off_policy_steps: int) -> int:
    """1 for an engine on the learner's GPU that samples in turn with the learner (k = 0);
    0 otherwise: on CPU (vLLM has no sleep mode there), for servers (they are not the
    learner's), and for rollouts sampled ahead (the engine works while the learner trains)."""
    return 1 if colocated_on_gpu and off_policy_steps == 0 else 0


def release_cached_memory(device: torch.device | None) -> None:
    """Give the learner's unused CUDA memory back to the driver (on `device`, None: the current
    one), so that the engine waking on the same GPU can have it.

    PyTorch's caching allocator keeps the blocks of the learner's peak (activations, gradients,
    optimizer temporaries) reserved once they are freed; the engine, a separate process, then
    allocates its weights and KV cache beside them and can run out of memory. Waiting for the
    learner's queued kernels first lets every freed block go (verl empties the cache the same
    way before it wakes its colocated engine). A process that never used CUDA holds nothing."""
    if not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class EngineSleep:
    """Puts `llm` (a `vllm.LLM` started with `enable_sleep_mode`) to sleep and wakes it as
    needed; with level 0 every call is a no-op. `device`: the learner's CUDA device, which the
    engine shares (None: the current one)."""

    def __init__(self, llm: Any, level: int, device: torch.device | None = None) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level {level}; allowed: {SLEEP_LEVELS}")
        self.llm, self.level, self.device = llm, level, device
        self.asleep: set[str] = set()

    def sleep(self) -> None:
        if self.level and not self.asleep:
            self.llm.sleep(level=self.level)
            self.asleep = {"weights", "kv_cache"}

    def wake(self, *tags: str) -> None:
        """Wake what `tags` name ("weights", "kv_cache") if it sleeps."""
        waking = [tag for tag in tags if tag in self.asleep]
        if waking:
            release_cached_memory(self.device)
            self.llm.wake_up(tags=waking)
            self.asleep.difference_update(waking)
