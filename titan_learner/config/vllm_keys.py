"""The [rollout.vllm] keys that are ours, not `vllm.LLM`'s: what the configuration reference
documents one by one and what the engine builders take out before the rest of the table goes
to vLLM as keyword arguments (`titan_learner.vllm.serve.OWN_KEYS` is this table's keys).

Config may import nothing above it, so the allowed values are written here as the checks in
`titan_learner.vllm` enforce them; a test holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineKey:
    """One [rollout.vllm] key as the reference prints it."""

    kind: str
    default: str
    allowed: str
    meaning: str


VLLM_OWN_KEYS: dict[str, EngineKey] = {
    "weight_transfer": EngineKey(
        "one of 'auto', 'ipc', 'nccl', 'nccl_m2n', 'gloo'",
        "'auto'",
        "",
        "The backend of vLLM's RL weight-transfer API that moves each update into the engines. "
        "auto: ipc for an engine on the rank's own GPU, nccl to servers on other GPUs, gloo on "
        "CPU and for a rank's engine over several GPUs (tensor_parallel_size > 1); nccl_m2n "
        "(servers on GPUs, with NVIDIA's nccl-extensions; max_off_policy_steps = 0): every "
        "trainer rank's shards resharded into the servers' tensor-parallel layout, no gather, "
        "not checked before the swap. gloo and nccl check each update against its "
        "manifest before the swap (one host copy of the export per worker during an update, "
        "so a tensor-parallel-8 server holds 8; "
        "servers from `titan-learner serve`).",
    ),
    "servers": EngineKey(
        "an array of strings",
        "unset",
        "non-empty, each 'http://...' or 'https://...' once",
        "Running `titan-learner serve` servers to sample on instead of an engine per rank.",
    ),
    "server_timeout_s": EngineKey(
        "a number",
        "3600",
        "> 0; with servers",
        "How long the job waits for a rollout server to answer one request (a prompt's samples, "
        "a weight update) before it stops with one line naming the server. Long completions "
        "on a busy server take minutes; a server that goes down mid-run is found at once.",
    ),
    "server_start_timeout_s": EngineKey(
        "a number",
        "600",
        "> 0; with servers",
        "How long the job, as it starts, waits for rollout servers that do not listen yet (a "
        "server started beside it opens its port once vLLM has loaded the model: ~30 s for the "
        "toy on 2 CPU cores, minutes for a large model), naming them; then it stops with one "
        "line. A server that answers with an error is one line at once.",
    ),
    "token_file": EngineKey(
        "a string",
        "unset",
        "",
        "The file holding the servers' bearer token ($TITAN_LEARNER_SERVER_TOKEN wins over it; "
        "one of the two is required on the servers and the job's nodes; never the token itself "
        "in the TOML, which run directories copy).",
    ),
    "sleep_level": EngineKey(
        "an integer",
        "1 on a GPU when max_off_policy_steps = 0, else 0",
        "0 or 1; 1 needs CUDA, no servers and max_off_policy_steps = 0",
        "Whether an engine on the learner's GPU sleeps between rollouts (vLLM's sleep mode: "
        "weights to host memory, KV cache dropped, so the update has the GPU).",
    ),
}
"""Keyed by the TOML key."""

PASS_THROUGH = (
    "Every other key is a keyword argument of `vllm.LLM` (gpu_memory_utilization, "
    "enforce_eager, ...), given as written. Set by the job, not here: model ([rollout] "
    "model_path), dtype ([learner] export_dtype), seed ([run] seed). Defaults: max_model_len = "
    "[data] max_prompt_tokens + the longest max_new_tokens (a whole episode with [env]; a "
    "smaller value is refused: vLLM would cut completions short), gpu_memory_utilization 0.5 on a GPU, and on CPU "
    "kv_cache_memory_bytes sized for the job's rows unless either sizing key is set."
)
"""The reference's one row for the keys that pass through to vLLM."""


ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 takes (vllm.config.lora.MaxLoRARanks)."""
ENGINE_LORA_KEYS = ("enable_lora", "max_loras", "max_lora_rank")
"""vLLM's LoRA arguments, set by [model.lora] push = "adapter"."""
