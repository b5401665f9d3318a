"""[logging] wandb: an offline W&B run holds what metrics.jsonl holds, under the same names, with
the resolved config, the evaluation completions as a table and the curves; a resume continues
the same run; a missing package is one line naming the extra. Offline only (no network here):
the records are read back from the run's `.wandb` file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support import wandb_offline
from titan_learner.cli import main
from titan_learner.config.toml import config_from_dict, load_config
from titan_learner.job.grpo import run
from titan_learner.job.telemetry import Telemetry
from titan_learner.job.wandb_run import RUN_ID_FILE, WandbRun

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"
OFFLINE = 'logging.wandb={project="toy", mode="offline", name="first", tags=["a", "b"]}'


@pytest.fixture(autouse=True)
def wandb_home(tmp_path, monkeypatch):
    """W&B's settings, cache and staging in the test's directory, not the user's."""
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / variable.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)


def _config(**wandb):
    section = {"project": "unit", "mode": "offline", **wandb}
    return config_from_dict({"logging": {"wandb": section}})


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_record_the_config_a_completions_table_and_the_curves(tmp_path):
    config = _config(name="unit-run", tags=["x"])
    wandb = WandbRun(config, tmp_path, resume=False, quiet=True)
    telemetry = Telemetry(tmp_path, total_steps=2, terminal=False, wandb=wandb)
    telemetry.log(0, {"reward_mean": 0.25, "pass@1": 0.5}, namespace="eval/")
    for step in (1, 2):
        telemetry.log(step, {"reward_mean": 0.1 * step, "loss_objective": 1.0 / step})
    completions = tmp_path / "eval.jsonl"
    rows = [{"prompt": "1+1", "completions": ["2", "3"], "rewards": [1.0, 0.0], "passed": 1}]
    completions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    telemetry.completions(2, completions)
    telemetry.close()

    [file] = wandb_offline.run_files(tmp_path)
    logged = wandb_offline.history(file)
    assert [row for row in logged if "curves/_type" not in row and "step" in row][:3] == _jsonl(
        tmp_path / "metrics.jsonl"
    )  # every record, the same names and values, in order
    table = next(row for row in logged if "eval/completions/_type" in row)
    assert (table["step"], table["eval/completions/nrows"]) == (2, 2)
    assert table["eval/completions/ncols"] == 3
    saved = tmp_path / "wandb" / file.parent.name / "files" / table["eval/completions/path"]
    assert json.loads(saved.read_text())["columns"] == ["prompt", "completion", "reward"]
    assert json.loads(saved.read_text())["data"] == [["1+1", "2", 1.0], ["1+1", "3", 0.0]]
    assert any(row.get("curves/_type") == "image-file" for row in logged)
    record = wandb_offline.run_record(file)
    assert (record.project, record.display_name, list(record.tags)) == ("unit", "unit-run", ["x"])
    assert record.run_id == (tmp_path / RUN_ID_FILE).read_text().strip()
    logged_config = wandb_offline.config(file)
    assert logged_config["logging"]["wandb"]["project"] == "unit"
    assert logged_config["optimizer"]["lr"] == config.optimizer.lr  # the resolved config


def test_a_resume_continues_the_same_run_and_a_fresh_start_begins_another(tmp_path):
    config = _config()
    ids = []
    for resume in (False, True, False):
        wandb = WandbRun(config, tmp_path, resume=resume, quiet=True)
        ids.append(wandb.run.id)
        wandb.finish(None)
        assert (tmp_path / RUN_ID_FILE).read_text() == ids[-1] + "\n"
    first, resumed, fresh = ids
    assert first == resumed != fresh


def test_the_job_logs_what_metrics_jsonl_holds_and_a_resume_continues_its_run(tmp_path):
    out = tmp_path / "run"

    def toy(steps: int, resume: bool) -> None:
        overrides = [
            f"run.steps={steps}",
            f'run.output_dir="{out}"',
            "checkpoint.interval=1",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "eval.max_prompts=4",
            OFFLINE,
        ]
        run(load_config(TOY, overrides), resume=resume, verbosity="quiet")

    toy(1, resume=False)
    toy(2, resume=True)
    first, resumed = wandb_offline.run_files(out)
    assert wandb_offline.run_record(first).run_id == wandb_offline.run_record(resumed).run_id
    logged = [
        row
        for file in (first, resumed)
        for row in wandb_offline.history(file)
        if not any(key.endswith("/_type") for key in row)  # tables and images
    ]
    assert logged == _jsonl(out / "metrics.jsonl")  # eval 0, step 1, eval 1 | step 2, eval 2
    names = {key for row in logged for key in row}
    assert {"training/reward_mean", "training/tokens_per_s", "eval/pass@1"} <= names
    tables = [row for row in wandb_offline.history(resumed) if "eval/completions/_type" in row]
    assert [row["step"] for row in tables] == [2]
    record = wandb_offline.run_record(first)
    assert (record.project, record.display_name, list(record.tags)) == ("toy", "first", ["a", "b"])


def test_a_missing_wandb_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name)
    )
    out = f'run.output_dir="{tmp_path / "run"}"'
    assert main(["train", "--config", str(TOY), "--set", OFFLINE, "--set", out]) == 2
    assert not (tmp_path / "run").exists()  # before anything
    assert capsys.readouterr().err == (
        f"error: {TOY}: [logging] wandb: the wandb package is not installed; allowed: "
        'pip install "titan_learner[wandb]", or no [logging] wandb\n'
    )


def test_an_online_run_without_a_login_is_one_line(tmp_path, monkeypatch):
    from titan_learner.config.errors import ConfigError
    from titan_learner.job.wandb_run import start_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError) as info:
        start_wandb(_config(mode="online"), tmp_path, resume=False, quiet=True)
    assert str(info.value) == (
        "<config>: [logging] wandb: cannot start the W&B run: No API key configured. Use "
        "`wandb login` to log in; allowed: `wandb login` (or WANDB_API_KEY) for mode = "
        '"online", or mode = "offline"'
    )
    assert start_wandb(_config(mode="disabled"), tmp_path, resume=False, quiet=True) is None
