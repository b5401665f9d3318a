"""The one table of dtypes a config, a command line or a receiver may name."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The long names a config uses ([learner] export_dtype, autocast_dtype, param_dtype)."""

DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
"""Every spelling the command line takes (short and long)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """bf16/bfloat16, fp16/float16, fp32/float32 (or the torch dtype itself)."""
    from titan_learner.config.errors import ConfigError

    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ConfigError(
        f"{dtype!r} is not an export dtype; allowed: {', '.join(DTYPE_NAMES)}", source="--dtype"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own name of a dtype ("float32", "bfloat16"): what manifests, update infos and
    Hugging Face configs record, and `getattr(torch, name)` reads back."""
    return str(dtype).removeprefix("torch.")
