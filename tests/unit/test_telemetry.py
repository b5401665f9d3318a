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
    telemetry = Telemetry(tmp_path, total_steps=3, progress=False)
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
    telemetry = Telemetry(tmp_path, total_steps=2, progress=False)
    telemetry.log(1, {**_metrics(1), "reward_errors": 0.0})
    telemetry.log(2, {**_metrics(2), "reward_errors": 3.0})
    telemetry.close()
    first, second = capsys.readouterr().out.splitlines()
    assert "reward_errors" not in first and second.endswith("  reward_errors=3")


def test_resume_drops_later_steps_and_appends(tmp_path: Path) -> None:
    first = Telemetry(tmp_path, total_steps=6, progress=False)
    _log_steps(first, range(1, 5))
    first.close()

    resumed = Telemetry(tmp_path, total_steps=6, progress=False, start_step=2)
    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2]
    _log_steps(resumed, range(3, 7))
    assert resumed.close().exists()

    assert [r["step"] for r in _jsonl(tmp_path)] == [1, 2, 3, 4, 5, 6]
    steps = [step for step, _ in _tensorboard_scalars(tmp_path, "training/reward_mean")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_elapsed_s_continues_across_a_resume(tmp_path: Path) -> None:
    first = Telemetry(tmp_path, total_steps=4, progress=False)
    for step in (1, 2, 3):
        first.log(step, {**_metrics(step), "elapsed_s": 10.0 * step})
    first.close()
    resumed = Telemetry(tmp_path, total_steps=4, progress=False, start_step=2)  # step 3 dropped
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
