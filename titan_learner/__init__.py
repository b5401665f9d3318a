"""titan_learner: TorchTitan-sharded LLM policies trained with TorchRL losses, from one TOML file.

The public API. `import titan_learner` is cheap: each name below is imported on first use
(torch, TorchTitan and TorchRL load only then).

    import titan_learner as tl

    config = tl.load_config("configs/debug.toml", overrides=["optimizer.lr=1e-4"])
    learner = tl.TitanLearner.from_config(config)   # joins or forms the process group
    metrics = learner.update(batch)                  # see tl.check_batch for the batch format
    tl.push_weights(learner, sink, bucket_bytes=64 << 20)
    learner.save("outputs/run/checkpoints")          # = tl.save(learner, ...); tl.load resumes

Where each name lives: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from titan_learner.noise import quiet_dependencies
from titan_learner.vllm.lazy_import import defer_vllm_import

quiet_dependencies()
defer_vllm_import()

_EXPORTS = {
    # config
    "Config": "titan_learner.config.schema",
    "ConfigError": "titan_learner.config.errors",
    "load_config": "titan_learner.config.toml",
    "config_from_dict": "titan_learner.config.toml",
    "validate": "titan_learner.job.validate",
    # learner
    "Learner": "titan_learner.learner.contract",
    "Capabilities": "titan_learner.learner.contract",
    "LocalLearner": "titan_learner.learner.local",
    "TitanLearner": "titan_learner.learner.titan",
    "LearnerStepper": "titan_learner.learner.torchrl_stepper",
    # batch format
    "check_batch": "titan_learner.learner.batch",
    "BatchError": "titan_learner.learner.batch",
    "TOKENS_KEY": "titan_learner.learner.batch",
    "ATTENTION_MASK_KEY": "titan_learner.learner.batch",
    "ASSISTANT_MASK_KEY": "titan_learner.learner.batch",
    "LOG_PROBS_KEY": "titan_learner.learner.batch",
    "REF_LOG_PROBS_KEY": "titan_learner.learner.batch",
    "ADVANTAGE_KEY": "titan_learner.learner.batch",
    "step_counts": "titan_learner.learner.loss.normalization",
    # weights
    "push_weights": "titan_learner.weights.sinks",
    "WeightSink": "titan_learner.weights.sinks",
    "StagingSink": "titan_learner.weights.sinks",
    "GeneratorSink": "titan_learner.weights.sinks",
    "HFModelSink": "titan_learner.weights.sinks",
    "SafetensorsDirSink": "titan_learner.weights.sinks",
    "VLLMSink": "titan_learner.vllm.torchrl_sink",
    "VLLMEngineSink": "titan_learner.vllm.engine_sink",
    "WeightsError": "titan_learner.weights.matching",
    "WeightsManifest": "titan_learner.weights.export",
    # checkpoints
    "save": "titan_learner.checkpoint.save_load",
    "load": "titan_learner.checkpoint.save_load",
    "latest": "titan_learner.checkpoint.layout",
    "CheckpointError": "titan_learner.checkpoint.errors",
    "export_checkpoint": "titan_learner.checkpoint.hf_export",
}

__all__ = [
    "ADVANTAGE_KEY",
    "ASSISTANT_MASK_KEY",
    "ATTENTION_MASK_KEY",
    "LOG_PROBS_KEY",
    "REF_LOG_PROBS_KEY",
    "TOKENS_KEY",
    "BatchError",
    "Capabilities",
    "CheckpointError",
    "Config",
    "ConfigError",
    "GeneratorSink",
    "HFModelSink",
    "Learner",
    "LearnerStepper",
    "LocalLearner",
    "SafetensorsDirSink",
    "StagingSink",
    "TitanLearner",
    "VLLMEngineSink",
    "VLLMSink",
    "WeightSink",
    "WeightsError",
    "WeightsManifest",
    "check_batch",
    "config_from_dict",
    "export_checkpoint",
    "latest",
    "load",
    "load_config",
    "push_weights",
    "save",
    "step_counts",
    "validate",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_learner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from titan_learner.checkpoint.errors import CheckpointError
    from titan_learner.checkpoint.hf_export import export_checkpoint
    from titan_learner.checkpoint.layout import latest
    from titan_learner.checkpoint.save_load import load, save
    from titan_learner.config.errors import ConfigError
    from titan_learner.config.schema import Config
    from titan_learner.config.toml import config_from_dict, load_config
    from titan_learner.job.validate import validate
    from titan_learner.learner.batch import (
        ADVANTAGE_KEY,
        ASSISTANT_MASK_KEY,
        ATTENTION_MASK_KEY,
        LOG_PROBS_KEY,
        REF_LOG_PROBS_KEY,
        TOKENS_KEY,
        BatchError,
        check_batch,
    )
    from titan_learner.learner.contract import Capabilities, Learner
    from titan_learner.learner.local import LocalLearner
    from titan_learner.learner.titan import TitanLearner
    from titan_learner.vllm.engine_sink import VLLMEngineSink
    from titan_learner.vllm.torchrl_sink import VLLMSink
    from titan_learner.weights.export import WeightsManifest
    from titan_learner.weights.matching import WeightsError
    from titan_learner.weights.sinks import (
        GeneratorSink,
        HFModelSink,
        SafetensorsDirSink,
        StagingSink,
        WeightSink,
        push_weights,
    )
