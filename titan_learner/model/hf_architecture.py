"""A model directory's architecture: its config.json mapped onto the TorchTitan model args.

With `[model] hf_checkpoint`, the shape of the model comes from the directory itself (dims,
heads, KV heads, head_dim, FFN width, vocabulary, RoPE base and llama3 scaling, norm eps, tied
embeddings), so `flavor` and `[model.overrides]` are optional; when given, they must agree with
it (one line naming both values). The inverse mapping is `model.hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import ModelOverrides, ModelSection

MODEL_TYPES = {"llama": "llama3", "qwen3": "qwen3"}
# [model.overrides] field -> config.json key
OVERRIDE_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "hidden_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
}


@dataclass(frozen=True)
class HFArchitecture:
    name: str
    overrides: ModelOverrides
    norm_eps: float
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None  # llama3-type scaling, else None


def read_architecture(
    directory: str, source: str, file_name: str = "config.json"
) -> HFArchitecture | None:
    """The architecture in `directory/config.json` (or `file_name`), None when there is none."""
    path = Path(directory) / file_name
    if not path.is_file():
        return None
    where = "[model] hf_checkpoint"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{path} is not readable JSON ({err})", source=source, where=where
        ) from None
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{path} has model_type {model_type!r}; allowed: {', '.join(MODEL_TYPES)}",
            source=source,
            where=where,
        )
    rope = data.get("rope_parameters") or {}
    values = {
        "rope_theta": data.get("rope_theta", rope.get("rope_theta")),
        **{field: data.get(key) for field, key in OVERRIDE_KEYS.items() if field != "rope_theta"},
    }
    if values["head_dim"] is None and values["dim"] and values["n_heads"]:
        values["head_dim"] = values["dim"] // values["n_heads"]
    missing = [OVERRIDE_KEYS[f] for f, v in values.items() if v is None and f != "max_seq_len"]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}", source=source, where=where)
    scaling = data.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    scaling_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if scaling_type not in (None, "llama3", "default"):
        raise ConfigError(
            f"{path}: RoPE scaling {scaling.get('rope_type')!r} is not supported; allowed: "
            "llama3 or none",
            source=source,
            where=where,
        )
    return HFArchitecture(
        name=MODEL_TYPES[model_type],
        overrides=ModelOverrides(**values),
        norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        rope_scaling=scaling if scaling_type == "llama3" else None,
    )


def agree(section: ModelSection, arch: HFArchitecture, source: str) -> ModelOverrides:
    """The overrides of `section` checked against the directory's; the directory's, whole."""
    directory = Path(section.hf_checkpoint or "")
    if section.name != arch.name:
        raise ConfigError(
            f"name = {section.name!r} but {directory / 'config.json'} describes a {arch.name} "
            f"model; allowed: name = {arch.name!r}",
            source=source,
            where="[model] name",
        )
    for field in dataclasses.fields(ModelOverrides):
        given = getattr(section.overrides, field.name)
        found = getattr(arch.overrides, field.name)
        if given is not None and found is not None and given != found:
            raise ConfigError(
                f"{field.name} = {given} but {directory / 'config.json'} has "
                f"{OVERRIDE_KEYS[field.name]} = {found}; allowed: leave it out (the directory "
                "decides) or the same value",
                source=source,
                where="[model.overrides]",
            )
    return arch.overrides


def apply_details(model_config: Any, arch: HFArchitecture) -> None:
    """What overrides do not carry: norm eps everywhere, tied embeddings, llama3 RoPE scaling."""
    model_config.enable_weight_tying = arch.tie_word_embeddings
    _replace_norm_eps(model_config, arch.norm_eps)
    for layer in model_config.layers:
        rope = layer.attention.rope
        if arch.rope_scaling is None:
            layer.attention.rope = dataclasses.replace(rope, scaling="none")
        else:
            s = arch.rope_scaling
            layer.attention.rope = dataclasses.replace(
                rope,
                scaling="llama",
                scaling_factor=float(s["factor"]),
                low_freq_factor=float(s["low_freq_factor"]),
                high_freq_factor=float(s["high_freq_factor"]),
                original_max_position_embeddings=int(s["original_max_position_embeddings"]),
            )


def _replace_norm_eps(node: Any, eps: float) -> None:
    """Every RMSNorm config in the model config tree gets `eps` (attention, FFN, q/k, final)."""
    if isinstance(node, list):
        for item in node:
            _replace_norm_eps(item, eps)
        return
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return
    for field in dataclasses.fields(node):
        value = getattr(node, field.name, None)
        if (
            dataclasses.is_dataclass(value)
            and hasattr(value, "eps")
            and hasattr(value, "normalized_shape")
        ):
            setattr(node, field.name, dataclasses.replace(value, eps=eps))
        else:
            _replace_norm_eps(value, eps)
