"""What changed between the config a checkpoint was trained with and the one resuming it.

The checkpoint root holds the config of its last save (`config.toml`). A change the checkpoint
cannot honour (the model's shape, the optimizer or loss class) is one line before anything is
loaded; every other change (learning rate, steps, loss coefficients, layout, data, rewards) is
applied and listed once: the resumed run follows its config, never silently the checkpoint's.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.config.toml import RESOLVED_CONFIG, config_to_toml, load_config

# Keys whose change a checkpoint cannot follow: they decide which tensors it holds.
FIXED_PREFIXES = ("model.name", "model.flavor", "model.overrides.", "optimizer.name", "loss.name")


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.key} {self.before!r} -> {self.after!r}"


def _flat(config: Config) -> dict[str, Any]:
    def walk(table: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in table.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                out.update(walk(value, f"{name}."))
            else:
                out[name] = value
        return out

    return walk(tomllib.loads(config_to_toml(config)), "")


def config_changes(before: Config, after: Config) -> list[Change]:
    """Every key whose value differs (a key present on one side only counts as changed)."""
    old, new = _flat(before), _flat(after)
    return [
        Change(key, old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    ]


def check_resume(checkpoints: Path, config: Config) -> list[Change]:
    """The allowed changes to apply; ConfigError (one line) for one the checkpoint cannot take."""
    saved = checkpoints / RESOLVED_CONFIG
    if not saved.is_file():
        return []
    changes = config_changes(load_config(saved), config)
    for change in changes:
        if change.key.startswith(FIXED_PREFIXES):
            section, _, key = change.key.rpartition(".")
            raise ConfigError(
                f"the checkpoint in {checkpoints} was trained with {key} = {change.before!r}, "
                f"the config says {change.after!r}; allowed: {change.before!r} (what a "
                "checkpoint holds cannot change on resume), or a new output_dir",
                source=config.source,
                where=f"[{section}] {key}",
            )
    return changes


def saved_normalizers(checkpoints: Path) -> set[str] | None:
    """The rewards whose running statistics the checkpoint holds (`normalize = "running"` in
    the config it saved): a normalizer added on resume starts afresh. None: not known."""
    from titan_learner.rewards.runner import reward_name

    saved = checkpoints / RESOLVED_CONFIG
    if not saved.is_file():
        return None
    return {reward_name(s) for s in load_config(saved).reward if s.normalize == "running"}


def touches_hyperparameters(changes: list[Change]) -> bool:
    """Whether the optimizer's or the loss's settings changed (they are in the checkpoint)."""
    return any(c.key.startswith(("optimizer.", "loss.")) for c in changes)
