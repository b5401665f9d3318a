"""The run's TOML file: schema, reading and writing it, and the checks of the file alone (every
check a run gets before any compute: `titan_learner.job.validate`)."""

from titan_learner.config.errors import ConfigError, did_you_mean
from titan_learner.config.schema import SECTIONS, Config, LossSection, ModelSection
from titan_learner.config.toml import (
    RESOLVED_CONFIG,
    apply_overrides,
    config_from_dict,
    config_to_toml,
    load_config,
)
from titan_learner.config.validate import check_world_size

__all__ = [
    "RESOLVED_CONFIG",
    "SECTIONS",
    "Config",
    "ConfigError",
    "LossSection",
    "ModelSection",
    "apply_overrides",
    "check_world_size",
    "config_from_dict",
    "config_to_toml",
    "did_you_mean",
    "load_config",
]
