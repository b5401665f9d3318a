"""A LoRA run's adapters served by a vLLM engine (`[model.lora] push = "adapter"`); rollout
servers take them through vllm.adapter_route instead (vllm.server_generator uploads them).

The engine loads the frozen base itself, from `[model] hf_checkpoint`, once; each push is then
the adapters alone (PEFT names and files, titan_learner.weights.peft): written to a directory
of its own and added to the engine as a new LoRA adapter (vLLM's `add_lora`, a new id per
push), which every request of the next rollout names. The version before is removed
from the engine and from disk once the new one is loaded. An 8B model at rank 16 on every
linear layer sends tens of megabytes a step instead of 16 GB of bf16 weights.

A new id per push, not `load_inplace`: vLLM reloads an in-place adapter from disk at every
scheduling step that names it, where a new id is read once (a version pushed twice, as at a
resume, gets its own id too).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_learner.config.vllm_keys import ENGINE_LORA_RANKS
from titan_learner.weights.matching import match_named_tensors
from titan_learner.weights.peft import CONFIG_FILE, WEIGHTS_FILE, peft_config


def engine_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM takes that holds adapters of `rank`."""
    return next(allowed for allowed in ENGINE_LORA_RANKS if allowed >= rank)


def lora_engine_arguments(rank: int) -> dict:
    """vLLM's engine arguments (vllm.LLM's, and a server's flags) for one adapter of `rank` at a
    time."""
    return {"enable_lora": True, "max_lora_rank": engine_lora_rank(rank), "max_loras": 1}


@dataclass(frozen=True)
class AdapterServing:
    """What an engine needs to serve a run's adapters."""

    rank: int
    alpha: float
    base: str
    """The base model's directory: the engine's own model, and the adapters' base."""
    shapes: dict[str, tuple[int, ...]]
    """Every adapter tensor a push holds, by PEFT name."""

    def engine_arguments(self) -> dict:
        return lora_engine_arguments(self.rank)


class AdapterSlot:
    """The engine's one adapter of the policy: `load` checks a push's names and shapes, writes
    its files and adds it to the engine; `request` is what the next rollout names."""

    def __init__(self, llm, serving: AdapterServing) -> None:
        self.llm = llm
        self.serving = serving
        self.root = Path(tempfile.mkdtemp(prefix="titan_learner_adapters_", dir=memory_dir()))
        self.request = None  # vllm's LoRARequest of the adapter now served, None before a push
        self.pushes = 0

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        incoming = match_named_tensors(
            named_tensors,
            self.serving.shapes,
            required=list(self.serving.shapes),
            rejected="the engine rejected the adapters, nothing was loaded",
        )
        self.pushes += 1
        directory = self.root / f"push{self.pushes}-v{version}"
        directory.mkdir()
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in incoming.items()}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        serving = self.serving
        settings = peft_config(serving.rank, serving.alpha, list(tensors), serving.base)
        (directory / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        request = LoRARequest(directory.name, self.pushes, str(directory))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"the vLLM engine did not load the adapters of version {version}")
        previous, self.request = self.request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def memory_dir() -> str | None:
    """/dev/shm where it can be written (memory, as the engine on this host reads it back at
    once), else the system's temporary directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def adapter_push(config) -> bool:
    """Whether the run's engines take its adapters alone (`[model.lora] push = "adapter"`)."""
    return config.model.lora is not None and config.model.lora.push == "adapter"


def adapter_serving(config, spec) -> AdapterServing:
    """The run's adapters as its engines serve them: shapes from the model built on the meta
    device (no memory), base from `[model] hf_checkpoint` (the config checks require it)."""
    from titan_learner.model.spec import build_meta
    from titan_learner.weights.peft import iter_peft_tensors

    lora = config.model.lora
    shapes = {name: tuple(t.shape) for name, t in iter_peft_tensors(build_meta(spec), spec)}
    return AdapterServing(lora.rank, lora.alpha, config.model.hf_checkpoint, shapes)
