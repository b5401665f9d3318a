"""Rewards: the built-ins on known answers, user functions, and every way a reward can fail."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import config_from_dict
from titan_learner.job.evaluation import pass_at_k
from titan_learner.rewards.builtins import final_answer, gold_answer
from titan_learner.rewards.loading import RewardLoadError, load_function
from titan_learner.rewards.runner import (
    Reward,
    RewardError,
    build_rewards,
    check_error_fractions,
    score,
)

ROW = {"answer": "Natalia sold 48/2 = 24 clips in May. #### 72"}


def rewards_of(tmp_path, tables: list[dict]):
    config = config_from_dict({"reward": tables}, source=str(tmp_path / "run.toml"))
    return build_rewards(config)


def totals(rewards, completions, row=ROW):
    """One rank's scores of a step, its error fractions judged as the job does alone."""
    n = len(completions)
    origins = [f"data.jsonl:{i + 1}" for i in range(n)]
    scores = score(rewards, ["p"] * n, completions, [row] * n, origins)
    check_error_fractions(rewards, [scores.failures])
    return scores


def test_final_answer_is_the_last_boxed_else_the_last_number():
    assert final_answer("so \\boxed{\\frac{1}{2}} and then \\boxed{72}") == "72"
    assert final_answer("nested \\boxed{x^{2}} done") == "x^{2}"
    assert final_answer("we get 1,234 and finally -3.5 apples") == "-3.5"
    assert final_answer("no answer here") is None
    assert gold_answer(ROW["answer"]) == "72" and gold_answer(" 3/4 ") == "3/4"


def test_math_reward_checks_the_answer_mathematically(tmp_path):
    rewards = rewards_of(tmp_path, [{"function": "math"}])
    completions = ["... \\boxed{72}", "I think 72", "\\boxed{71}", "no number", "72.0 total"]
    assert totals(rewards, completions).total.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    half = {"answer": "0.5"}
    assert totals(
        rewards, ["\\boxed{\\frac{1}{2}}", "about 0.50", "\\boxed{2}"], half
    ).total.tolist() == [
        1.0,
        1.0,
        0.0,
    ]


def test_exact_match_regex_weights_and_per_reward_scores(tmp_path):
    rewards = rewards_of(
        tmp_path,
        [
            {"function": "exact_match"},
            {"function": "regex", "pattern": "\\\\boxed\\{", "credit": 0.1, "name": "format"},
            {"function": "regex", "pattern": "[0-9]+", "mode": "fullmatch", "weight": 2.0},
        ],
    )
    row = {"answer": " 42 "}
    scores = totals(rewards, ["42", "\\boxed{42}", "  42\n"], row)
    assert scores.per_reward["exact_match"].tolist() == [1.0, 0.0, 1.0]
    assert scores.per_reward["format"].tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert scores.per_reward["regex"].tolist() == [1.0, 0.0, 0.0]
    assert scores.total.tolist() == pytest.approx([3.0, 0.1, 1.0])


def write(tmp_path, text: str, name: str = "my_rewards.py"):
    (tmp_path / name).write_text(text)


def test_a_user_function_from_a_file_next_to_the_config(tmp_path):
    write(tmp_path, "def score(prompt, completion, row):\n    return len(completion) / 10\n")
    rewards = rewards_of(tmp_path, [{"function": "my_rewards.py:score"}])
    assert rewards[0].name == "score"
    assert totals(rewards, ["abc", ""]).total.tolist() == pytest.approx([0.3, 0.0])
    assert load_function("math_verify:parse", tmp_path).__name__ == "parse"  # a module path


@pytest.mark.parametrize(
    ("text", "spec", "message"),
    [
        ("", "nope.py:score", "'nope.py:score': file .*nope.py not found"),
        ("x = 1\n", "my_rewards.py:score", "my_rewards.py has no attribute 'score'"),
        ("score = 3\n", "my_rewards.py:score", "score is a int, not a function"),
        ("raise NameError('oops')\n", "my_rewards.py:score", "running .* failed: NameError: oops"),
        ("def score(a):\n    return 0\n", "my_rewards.py:score", "cannot be called as score"),
        ("", "no_such_module:score", "importing no_such_module failed: ModuleNotFoundError"),
        ("", "my_rewards.py", "names no function"),
    ],
)
def test_a_reward_that_cannot_load_says_why(tmp_path, text, spec, message):
    if text:
        write(tmp_path, text)
    with pytest.raises(RewardLoadError, match=message):
        load_function(spec, tmp_path)


def failing(value=None, sleep: float = 0.0, on_error: str = "raise"):
    def function(prompt, completion, row):
        if completion == "bad":
            if sleep:
                time.sleep(sleep)
            if isinstance(value, Exception):
                raise value
            return value
        return 0.5

    return Reward("mine", "my_rewards.py:score", function, 1.0, 0.2, on_error)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (failing(ValueError("boom")), "raised (ValueError: boom)"),
        (failing(math.nan), "returned nan, not a finite number"),
        (failing("0.5"), "returned '0.5' (str), not a number"),
        (failing(None, sleep=5.0), "timed out: no result after 0.2 s"),
    ],
)
def test_a_reward_that_fails_stops_with_one_line_naming_the_row(reward, message):
    with pytest.raises(RewardError) as info:
        totals([reward], ["ok", "bad", "ok"])
    text = str(info.value)
    assert text.startswith("reward 'mine' (my_rewards.py:score) ") and "\n" not in text
    assert message in text and "on data.jsonl:2" in text


def test_on_error_zero_scores_zero_and_counts(tmp_path):
    reward = failing(None, sleep=5.0, on_error="zero")
    start = time.monotonic()
    scores = totals([reward], ["ok", "bad", "ok", "bad"])
    assert time.monotonic() - start < 2.0  # a hung call is abandoned, the rest goes on
    assert scores.total.tolist() == [0.5, 0.0, 0.5, 0.0] and scores.errors == 2
    assert len(scores.messages) == 2


def test_errors_beyond_max_error_fraction_stop_with_the_count_and_the_first_error():
    """on_error = "zero" tolerates a few failures per step, not a reward broken on every row."""
    broken = failing("0.5", on_error="zero")  # a string: an error on every "bad" completion
    with pytest.raises(RewardError) as info:
        totals([broken], ["bad", "ok", "bad", "bad"])
    assert str(info.value) == (
        "reward 'mine' (my_rewards.py:score) failed on 3 of 4 completions, more than "
        "max_error_fraction = 0.5 (fix the reward, or raise it); the first: returned '0.5' "
        "(str), not a number on data.jsonl:1"
    )
    at_the_limit = totals([broken], ["bad", "ok", "bad", "ok"])  # 2 of 4: not more than half
    assert at_the_limit.errors == 2 and at_the_limit.total.tolist() == [0.0, 0.5, 0.0, 0.5]
    lenient = dataclasses.replace(broken, max_error_fraction=1.0)
    assert totals([lenient], ["bad"] * 4).errors == 4
    strict = dataclasses.replace(broken, max_error_fraction=0.0)
    with pytest.raises(RewardError, match="failed on 1 of 4 completions"):
        totals([strict], ["ok", "ok", "bad", "ok"])


def test_the_error_fraction_is_over_the_steps_completions_on_every_rank():
    """A rank whose rows happen to break the reward must not stop a step whose completions
    mostly scored; the first error named is the lowest rank's."""
    broken = failing("0.5", on_error="zero")
    rank0 = score([broken], ["p"] * 4, ["bad", "bad", "bad", "ok"], [ROW] * 4, list("abcd"))
    rank1 = score([broken], ["p"] * 4, ["ok"] * 4, [ROW] * 4, list("efgh"))
    check_error_fractions([broken], [rank0.failures, rank1.failures])  # 3 of 8
    rank1 = score([broken], ["p"] * 4, ["bad", "ok", "ok", "ok"], [ROW] * 4, list("efgh"))
    check_error_fractions([broken], [rank0.failures, rank1.failures])  # 4 of 8: not more
    rank1 = score([broken], ["p"] * 4, ["ok", "bad", "bad", "ok"], [ROW] * 4, list("efgh"))
    with pytest.raises(RewardError) as info:
        check_error_fractions([broken], [{}, rank1.failures, rank0.failures])  # {}: no rows
    assert str(info.value) == (
        "reward 'mine' (my_rewards.py:score) failed on 5 of 8 completions, more than "
        "max_error_fraction = 0.5 (fix the reward, or raise it); the first: returned '0.5' "
        "(str), not a number on f"
    )


def test_max_error_fraction_comes_from_the_config_and_is_a_fraction(tmp_path):
    [reward] = rewards_of(tmp_path, [{"function": "math", "on_error": "zero"}])
    assert reward.max_error_fraction == 0.5
    tables = [{"function": "math", "max_error_fraction": 0.25}]
    assert rewards_of(tmp_path, tables)[0].max_error_fraction == 0.25
    with pytest.raises(ConfigError, match="max_error_fraction"):
        rewards_of(tmp_path, [{"function": "math", "max_error_fraction": 1.5}])


def test_pass_at_k_on_constructed_cases():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(2, 3, 1)


def test_the_readmes_reward_configs_pass_the_structure_checks():
    """Every ```toml block of the README's rewards section parses and passes the checks of the
    file alone (its paths and endpoints are examples, not on this machine)."""
    import re
    import tomllib
    from pathlib import Path

    from titan_learner.job.checks import check_reward_kind

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Rewards\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.DOTALL)
    kinds = set()
    for block in blocks:
        config = config_from_dict(tomllib.loads(block))
        for index, reward in enumerate(config.reward):
            check_reward_kind(config, reward, f"[[reward]] #{index + 1}")
            kinds |= {k for k in ("function", "model", "judge") if getattr(reward, k)}
    assert len(blocks) == 3 and kinds == {"function", "model", "judge"}
