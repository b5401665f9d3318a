"""`titan-learner export --adapter`: a LoRA checkpoint's adapters as a PEFT directory.

    python -m titan_learner export --checkpoint DIR --out ADAPTER_DIR --adapter [--dtype bf16]
                                   [--config FILE] [--step N]

Writes `adapter_config.json` (r, lora_alpha, target_modules in Hugging Face names,
base_model_name_or_path: the run's `[model] hf_checkpoint`) and `adapter_model.safetensors`
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`, ...): the directory
`peft.PeftModel.from_pretrained(base, ADAPTER_DIR)` and `vllm serve BASE --enable-lora
--lora-modules name=ADAPTER_DIR` load (weights.peft maps TorchTitan's adapters onto them).

Only the adapters are read from the checkpoint and only they are allocated: the model is built
on the meta device, so exporting an 8B run's adapters takes megabytes, not the base's memory.
The files go to a hidden sibling directory renamed onto the output once complete, as `export`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from titan_learner.checkpoint.hf_export import (
    ExportError,
    export_model_spec,
    prepare_export,
    staging,
)
from titan_learner.checkpoint.layout import checkpoint_root
from titan_learner.checkpoint.model_weights import load_model_weights
from titan_learner.config.schema import Config
from titan_learner.model.spec import build_meta
from titan_learner.weights.lora import lora_modules
from titan_learner.weights.peft import CONFIG_FILE, WEIGHTS_FILE, iter_peft_tensors, peft_config


def export_adapter(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    config: Config | str | os.PathLike | None = None,
    step: int | None = None,
) -> Path:
    """Write the LoRA adapters of a checkpoint as a PEFT directory `out_dir`; return its path.

    Arguments as `export_checkpoint`'s. Raises ConfigError, CheckpointError or ExportError with
    one clear message on bad input (a run without [model.lora] among them), before any output
    exists. The caller's torch RNG state is left as it was.
    """
    from safetensors.torch import save_file

    out, checkpoint_dir, config, torch_dtype = prepare_export(
        checkpoint_dir, out_dir, dtype, config, step
    )
    lora = config.model.lora
    if lora is None:
        raise ExportError(
            f"checkpoint {checkpoint_dir} is of a run without [model.lora]: it holds no "
            "adapters; allowed: export without --adapter (the whole model)"
        )
    with torch.random.fork_rng(devices=[]):
        spec = export_model_spec(config, checkpoint_root(checkpoint_dir))
        model = build_meta(spec)
        for _, layer in lora_modules(model):  # the adapters alone get memory
            layer.lora_a.to_empty(device="cpu")
            layer.lora_b.to_empty(device="cpu")
        load_model_weights(model, checkpoint_dir, step)
        tensors = {
            name: tensor.to(torch_dtype).contiguous()
            for name, tensor in iter_peft_tensors(model, spec)
        }
    settings = peft_config(lora.rank, lora.alpha, list(tensors), config.model.hf_checkpoint)
    with staging(out) as directory:
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    return out
