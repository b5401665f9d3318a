"""What a rollout server must run for this job, read from what it reports of itself (vLLM's
`/server_info`) before any transfer.

`titan-learner serve --config` starts a server with all of it; a server started from another
config, an older version of this one, or by hand may differ, and each difference is one line
naming the server, both values and the fix:
- its weight-transfer backend: vLLM's nccl_m2n trainer would wait in NCCL for workers that
  never join;
- its max_model_len: vLLM ends a completion at max_model_len tokens without an error
  (finish_reason "length"), so a shorter one cuts the run's completions short in silence;
- its dtype: the run's export is cast to the server's, and its log-probs are not the
  precision the run compares with the learner's;
- its log-prob mode: the job weighs samples by the model's raw log-probs (before temperature
  and penalties, as the learner computes them).
"""

from __future__ import annotations

from typing import Any

import torch

from titan_learner.vllm.backends import engine_backend
from titan_learner.vllm.server_client import ServerError

RESTART = "restart it with this run's config (titan-learner serve --config ...)"
RAW_LOGPROBS = "raw_logprobs"


def check_served(
    url: str, served: dict[str, Any], *, transfer: str, dtype: torch.dtype, sequence_len: int
) -> None:
    """ServerError naming the first way the server at `url` (its vLLM config: `served`) does
    not run what this job needs: `transfer`'s backend, sequences of `sequence_len` tokens,
    weights in `dtype`, raw log-probs."""
    check_served_backend(url, served, transfer)
    model = served.get("model_config") or {}
    longest = model.get("max_model_len")
    if longest is not None and longest < sequence_len:
        raise ServerError(
            f"rollout server {url} takes sequences of at most {longest} tokens (max_model_len) "
            f"and this run's take up to {sequence_len}: vLLM would end its completions at "
            f"{longest} tokens without an error; allowed: {RESTART}"
        )
    runs_in = str(model.get("dtype", dtype)).removeprefix("torch.")
    exports = str(dtype).removeprefix("torch.")
    if runs_in != exports:
        raise ServerError(
            f"rollout server {url} runs in {runs_in} and this run exports {exports} ([learner] "
            f"export_dtype); allowed: {RESTART}, or the same export_dtype in both"
        )
    mode = model.get("logprobs_mode", RAW_LOGPROBS)
    if mode != RAW_LOGPROBS:
        raise ServerError(
            f"rollout server {url} returns {mode} and the job weighs its samples by "
            f"{RAW_LOGPROBS} (the model's own, as the learner computes them); allowed: "
            f"{RESTART}, which sets --logprobs-mode {RAW_LOGPROBS}"
        )


def check_served_backend(url: str, served: dict[str, Any], transfer: str) -> None:
    """A server must run the worker engine of the backend the job sends with."""
    config = served.get("weight_transfer_config") or {}
    expected = engine_backend(transfer)
    if config.get("backend") != expected:
        raise ServerError(
            f"rollout server {url} runs weight-transfer backend {config.get('backend')!r} and "
            f"this run sends with {transfer!r} (backend {expected!r}); allowed: {RESTART}, or "
            "the same [rollout.vllm] weight_transfer in both"
        )
