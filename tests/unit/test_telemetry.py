"""Telemetry writes every step to the console, metrics.jsonl and TensorBoard, and plots on close."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_learner.job.telemetry import Telemetry


def _metrics(step: int) -> dict[str, float]:
    return {
        "reward_mean": 0.1 * step,
        "reward_min": 0.1 * step - 0.05,
        "reward_max": 0.1 * step + 0.05,
        "loss_objective": 1.0 / step,
        "loss_kl_to_ref": 0.01 * step,
        "grad_norm": 2.0 + step,
        "rollout_s": 1.23456,
    }


def _log_steps(telemetry: Telemetry, steps: range) -> None:
    for step in steps:
        telemetry.log(step, _metrics(step))


def _jsonl(output_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_scalars(output_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(output_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_logs_every_step_everywhere_and_plots_on_close(tmp_path: Path, capsys) -> None:
    telemetry = Telemetry(tmp_path, total_steps=3, terminal=False)
    _log_steps(telemetry, range(1, 4))

    records = _jsonl(tmp_path)  # readable before close: every line is flushed
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(records[0]) == {"step"} | {f"training/{k}" for k in _metrics(1)}
    assert records[1]["training/reward_mean"] == 0.2

    png = telemetry.close()
    assert png == tmp_path / "curves.png"
    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    scalars = _tensorboard_scalars(tmp_path, "training/reward_mean")
    assert [step for step, _ in scalars] == [1, 2, 3]
    assert [value for _, value in scalars] == pytest.approx([0.1, 0.2, 0.3])  # float32 in TB

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith("step 2/3")
    assert "reward_mean=0.2" in lines[1]
    assert "rollout_s=1.235" in lines[1]  # 4 significant digits


def test_reward_errors_show_on_the_console_line_only_when_there_are_some(tmp_path, capsys):
    telemetry = Telemetry(tmp_path, total_steps=2, terminal=False)
    telemetry.log(1, {**_metrics(1), "reward_errors": 0.0})
    telemetry.log(2, {**_metrics(2), "reward_errors": 3.0})
    telemetry.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "reward_errors" not in first and second.endswith("  reward_errors=3")


def test_resume_drops_later_steps_and_appends(tmp_path: Path) -> None:
    first = Telemetry(tmp_path, total_steps=6, terminal=False)
    _log_steps(first, range(1, 5))
    first.close()

    resumed = Telemetry(tmp_path, total_steps=6, terminal=False, start_step=2)
    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2]
    _log_steps(resumed, range(3, 7))
    assert resumed.close().exists()

    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2, 3, 4, 5, 6]
    steps = [step for step, _ in _tensorboard_scalars(tmp_path, "training/reward_mean")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_elapsed_s_continues_across_a_resume(tmp_path: Path) -> None:
    first = Telemetry(tmp_path, total_steps=4, terminal=False)
    for step in (1, 2, 3):
        first.log(step, {**_metrics(step), "elapsed_s": 10.0 * step})
    first.close()
    resumed = Telemetry(tmp_path, total_steps=4, terminal=False, start_step=2)  # step 3 dropped
    resumed.log(3, {**_metrics(3), "elapsed_s": 4.0})  # this process's own clock
    resumed.log(1, {"pass@1": 0.5, "elapsed_s": 1.0}, namespace="eval/")  # not training time
    resumed.close()
    records = _jsonl(tmp_path)
    assert [r.get("training/elapsed_s") for r in records] == [10.0, 20.0, 24.0, None]
    assert records[-1]["eval/elapsed_s"] == 1.0


def test_curves_draw_length_and_kl_panels_and_tell_pass_at_1_from_pass_at_k(tmp_path):
    from titan_learner.job.telemetry import curves_figure

    records = [
        {"step": s, **{f"training/{k}": v for k, v in _metrics(s).items()}}
        | {
            "training/response_length_mean": 5.0 + s,
            "training/response_length_min": 1.0,
            "training/response_length_max": 8.0,
            "training/truncated_fraction": 0.1 * s,
            "training/kl_approx": 0.01 * s,
            "training/entropy": 2.0 - 0.1 * s,
            "training/reward_errors": float(s == 2),
        }
        for s in (1, 2, 3)
    ]
    records += [{"step": s, "eval/pass@1": 0.4, "eval/pass@k": 0.4} for s in (0, 3)]  # equal
    figure = curves_figure(records)
    titles = [ax.get_title() for ax in figure.axes]
    assert titles[:5] == [
        "reward",
        "loss terms",
        "grad_norm",
        "response length (tokens)",
        "KL (kl_approx: to the sampling policy) and entropy",
    ]
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    one, k = lines["eval pass@1"], lines["eval pass@k"]
    assert list(one.get_ydata()) == list(k.get_ydata())  # on top of each other, yet
    assert (one.get_marker(), one.get_linestyle()) != (k.get_marker(), k.get_linestyle())
    assert {line.get_label() for line in figure.axes[4].get_lines()} == {"kl_approx", "entropy"}
    right_axes = {ax.get_ylabel() for ax in figure.axes[5:]}
    assert right_axes == {"reward errors", "truncated fraction"}


def test_disabled_records_nothing(tmp_path: Path, capsys) -> None:
    telemetry = Telemetry.disabled()
    telemetry.log(1, _metrics(1))
    assert telemetry.close() is None

    off = Telemetry(tmp_path / "run", total_steps=1, enabled=False)
    off.log(1, _metrics(1))
    assert off.close() is None
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_a_failing_close_never_hides_the_error_that_ended_the_run(tmp_path):
    from titan_learner.job.grpo import close_quietly

    class Broken:
        def close(self):
            raise OSError(28, "No space left on device")

    with (
        pytest.raises(RuntimeError, match="the real error"),
        pytest.warns(
            UserWarning,
            match="closing the telemetry failed too: OSError: .*No space left on device",
        ),
    ):
        try:
            raise RuntimeError("the real error")
        except RuntimeError:
            close_quietly(Broken())
            raise


# -- the console -----------------------------------------------------------------------------------


def _console_run(tmp_path: Path, capsys, steps: int = 5, **console) -> tuple[list[str], str]:
    """`steps` logged steps and one evaluation; the stdout lines and the stderr text."""
    telemetry = Telemetry(tmp_path, total_steps=steps, **console)
    for step in range(1, steps + 1):
        telemetry.log(step, {**_metrics(step), "tokens_per_s": 1234.5})
    telemetry.log(steps, {"pass@1": 0.5}, namespace="eval/")
    telemetry.close()
    captured = capsys.readouterr()
    return captured.out.splitlines(), captured.err


def test_off_a_terminal_the_plain_line_prints_every_log_every_steps_and_the_last(tmp_path, capsys):
    lines, err = _console_run(tmp_path, capsys, terminal=False, log_every=2)
    steps = [line.split("  ")[0] for line in lines[:-1]]
    assert steps == ["step 2/5", "step 4/5", "step 5/5"]
    assert lines[-1] == "eval at step 5  pass@1=0.5"
    assert "reward_mean=0.4" in lines[1] and "tokens_per_s=1234" in lines[1]
    assert err == ""  # no bar in a log file
    assert len(_jsonl(tmp_path)) == 6  # the files get every step whatever is printed


def test_on_a_terminal_a_bar_shows_steps_time_left_and_key_figures(tmp_path, capsys):
    lines, err = _console_run(tmp_path, capsys, terminal=True)
    assert lines == ["eval at step 5  pass@1=0.5"]  # no per-step line: the bar says it
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert " 5/5 [" in final and "<00:00" in final, final  # steps, elapsed<left
    assert "reward=0.500" in final and "tok/s=1234" in final, final


def test_verbose_prints_every_metric_and_quiet_nothing(tmp_path, capsys):
    lines, _ = _console_run(tmp_path / "verbose", capsys, terminal=False, verbosity="verbose")
    assert len(lines) == 6
    for name in (*_metrics(1), "tokens_per_s"):
        assert f"{name}=" in lines[0], name
    lines, err = _console_run(tmp_path / "quiet", capsys, terminal=True, verbosity="quiet")
    assert (lines, err) == ([], "")
    assert len(_jsonl(tmp_path / "quiet")) == 6


def test_train_takes_quiet_or_verbose_not_both(capsys):
    from titan_learner.cli import build_parser

    parser = build_parser("titan-learner")
    assert parser.parse_args(["train", "--config", "x"]).verbosity == "normal"
    assert parser.parse_args(["train", "--config", "x", "--quiet"]).verbosity == "quiet"
    assert parser.parse_args(["train", "--config", "x", "--verbose"]).verbosity == "verbose"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--config", "x", "--quiet", "--verbose"])
    assert "not allowed with argument" in capsys.readouterr().err
