"""configs/recipes/*.toml: the README's recipes (GRPO, DAPO, Dr. GRPO, GSPO, CISPO) as the
Qwen3 GSM8K job, each passing `check` on the world size it names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_config import intended_world_size, run_check

RECIPES = Path(__file__).parents[2] / "configs" / "recipes"
NAMES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")


def test_every_recipe_is_listed():
    assert sorted(path.stem for path in RECIPES.glob("*.toml")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_recipe_passes_check(capsys, name):
    path = RECIPES / f"{name}.toml"
    world = intended_world_size(path)
    code, out, err = run_check(capsys, "--config", str(path), "--world-size", str(world))
    assert (code, err) == (0, ""), err
    assert f"world size: {world}   mesh: " in out
