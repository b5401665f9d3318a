"""The job's vLLM generators, built from a config: each rank's colocated engine, or the
[rollout.vllm] servers shared by every rank (`job.grpo.build_generator` picks)."""

from __future__ import annotations

import torch

from titan_learner.config.schema import Config


def build_engine_generator(config: Config, learner, dtype: torch.dtype, ids: dict):
    """Each rank's own in-process vLLM engine, on the rank's device."""
    from titan_learner.config.derived import longest_sequence
    from titan_learner.model.hf_config import hf_config
    from titan_learner.vllm.checks import engine_rows
    from titan_learner.vllm.engine_memory import cpu_engine_defaults, job_engine_memory
    from titan_learner.vllm.engine_model import engine_model
    from titan_learner.vllm.engine_sleep import default_sleep_level
    from titan_learner.vllm.generator import VLLMGenerator
    from titan_learner.vllm.lora_adapters import adapter_push, adapter_serving
    from titan_learner.vllm.serve import OWN_KEYS

    model_path, model_arguments = engine_model(config)
    # the KV cache is sized for what the job asks, not for the model's longest context
    engine = {"max_model_len": longest_sequence(config), **model_arguments} | {
        key: value for key, value in config.rollout.vllm.items() if key not in OWN_KEYS
    }
    if learner.device.type == "cpu":
        rows = engine_rows(config, learner.capabilities.data_parallel_size)
        memory = job_engine_memory(config, hf_config(learner.spec), rows=rows)
        engine |= cpu_engine_defaults(engine, memory)
    if adapter_push(config):
        engine["lora"] = adapter_serving(config, learner.spec)
    return VLLMGenerator(
        model_path,
        dtype=dtype,
        seed=config.run.seed,
        device=learner.device,
        weight_transfer=config.rollout.vllm.get("weight_transfer", "auto"),
        sleep_level=config.rollout.vllm.get(
            "sleep_level",
            default_sleep_level(
                colocated_on_gpu=learner.device.type == "cuda",
                off_policy_steps=config.rollout.max_off_policy_steps,
            ),
        ),
        **ids,
        **engine,
    )


def build_server_generator(config: Config, learner, dtype: torch.dtype, ids: dict):
    """The [rollout.vllm] servers, shared by every rank; rank 0 pushes the weights once every
    rank asked for them, or, on nccl_m2n, every rank sends its own shards (a collective: every
    rank builds it)."""
    from titan_learner.config.derived import longest_sequence
    from titan_learner.model.hf_config import hf_config
    from titan_learner.ranks import rank, world_size
    from titan_learner.vllm.lora_adapters import adapter_push, adapter_serving
    from titan_learner.vllm.push_gate import trainer_push_gate
    from titan_learner.vllm.serve import server_token
    from titan_learner.vllm.server_client import DEFAULT_START_TIMEOUT_S, DEFAULT_TIMEOUT_S
    from titan_learner.vllm.server_generator import ServerGenerator

    shards = None
    if config.rollout.vllm.get("weight_transfer") == "nccl_m2n":
        from titan_learner.vllm.m2n_source import local_shards

        shards = local_shards(learner.model, learner.spec, dtype, world_size())
    return ServerGenerator(
        config.rollout.vllm["servers"],
        hf_config(learner.spec),
        dtype=dtype,
        sequence_len=longest_sequence(config),
        sender=rank() == 0,
        weight_transfer=config.rollout.vllm.get("weight_transfer", "auto"),
        token=server_token(config),
        timeout_s=config.rollout.vllm.get("server_timeout_s", DEFAULT_TIMEOUT_S),
        start_timeout_s=config.rollout.vllm.get("server_start_timeout_s", DEFAULT_START_TIMEOUT_S),
        gate=trainer_push_gate(),
        shards=shards,
        lora=adapter_serving(config, learner.spec) if adapter_push(config) else None,
        **ids,
    )
