"""Errors of the vLLM family that the command line reports as one line."""

from __future__ import annotations

from typing import Any

from titan_learner.vllm.engine_memory import SIZING_KEYS


class EngineStartError(RuntimeError):
    """A vLLM engine that did not start.

    vLLM's engine process logs the cause; its parent sees only "Engine core initialization
    failed", so the error says what the engine was given and which settings size it."""


def engine_start_error(
    err: BaseException, engine_kwargs: dict[str, Any], on_gpu: bool
) -> EngineStartError:
    lines = str(err).strip().splitlines()
    given = [f"{key} = {engine_kwargs[key]}" for key in SIZING_KEYS if key in engine_kwargs]
    keys = "gpu_memory_utilization, max_model_len" if on_gpu else "kv_cache_memory_bytes"
    return EngineStartError(
        f"the vLLM engine did not start ({type(err).__name__}: "
        f"{lines[-1] if lines else 'no message'}; vLLM's log above says why); it was given "
        f"{', '.join(given) or 'vLLM defaults'}; what sizes it: [rollout.vllm] {keys}, "
        "[rollout] prompts_per_step, group_size and max_new_tokens, [data] max_prompt_tokens"
    )
