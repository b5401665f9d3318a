"""The run's TOML file: schema, reading and writing it, and every check it gets."""

from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.schema import SECTIONS, Config, LossSection, ModelSection
from titan_learner.config.toml import (
    RESOLVED_CONFIG,
    apply_overrides,
    config_from_dict,
    config_to_toml,
    load_config,
    save_resolved_config,
)
from titan_learner.config.validate import Validated, check_world_size, validate

__all__ = [
    "RESOLVED_CONFIG",
    "SECTIONS",
    "Config",
    "ConfigError",
    "LossSection",
    "ModelSection",
    "Validated",
    "apply_overrides",
    "check_world_size",
    "config_from_dict",
    "config_to_toml",
    "did_you_mean",
    "load_config",
    "save_resolved_config",
    "validate",
]
