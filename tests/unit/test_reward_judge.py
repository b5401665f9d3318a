"""An LLM judge's configuration: every bad key is one line and exit 2 before any compute; and
an endpoint that is down costs a bounded number of tries per completion, each an error of its
row. (Scoring through a real judge server: tests/integration/test_reward_judge.py.)"""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.hf_dirs import make_tokenizer, write_gsm8k_jsonl
from tests.unit.test_job_inputs import train, write_config
from titan_learner.config.toml import config_from_dict
from titan_learner.rewards.runner import build_rewards, score

TEMPLATE = (
    "Question: {{ prompt }}\\nReference: {{ answer }}\\nAnswer: {{ completion }}\\n"
    "Rate the answer from 0 to 10. Reply 'Score: N'."
)


def judge_table(**changes) -> dict:
    return {
        "base_url": "http://127.0.0.1:8000/v1",
        "model": "judge",
        "prompt": "judge.jinja",
        "parse": r"Score:\s*(\d+)",
        **changes,
    }


def inline(table: dict) -> str:
    def value(v):
        return f"'{v}'" if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v

    return "{ " + ", ".join(f"{k} = {value(v)}" for k, v in table.items()) + " }"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            judge_table(url="x"),
            "[[reward]] #2 judge: unknown key 'url'; allowed: base_url, model, prompt, parse, "
            "temperature, max_tokens, concurrency, retries, api_key_env",
        ),
        (
            {k: v for k, v in judge_table().items() if k != "model"},
            "[[reward]] #2 judge.model: missing or not a string; allowed: the served model's name",
        ),
        (
            judge_table(base_url="localhost:8000"),
            "[[reward]] #2 judge.base_url: 'localhost:8000'; allowed: http(s)://host:port/v1",
        ),
        (
            judge_table(parse=r"Score: \d+"),
            "[[reward]] #2 judge.parse: 'Score: \\\\d+' has 0 groups; allowed: exactly one",
        ),
        (
            judge_table(parse="Score: ("),
            "[[reward]] #2 judge.parse: 'Score: (' is not a regular expression",
        ),
        (
            judge_table(concurrency=0),
            "[[reward]] #2 judge.concurrency: 0; allowed: an integer >= 1 (default 8)",
        ),
        (
            judge_table(api_key_env="TITAN_LEARNER_TEST_UNSET_KEY"),
            "[[reward]] #2 judge.api_key_env: the environment variable "
            "TITAN_LEARNER_TEST_UNSET_KEY is not set (or empty); allowed: the judge's bearer "
            "token in it",
        ),
        (
            judge_table(api_key_env="sk-123"),
            "[[reward]] #2 judge.api_key_env: 'sk-123'; allowed: the name of an environment "
            "variable",
        ),
        (
            judge_table(prompt="missing.jinja"),
            "[[reward]] #2 judge.prompt: {root}/missing.jinja not found; allowed: a Jinja "
            "template file",
        ),
        (
            judge_table(prompt="broken.jinja"),
            "[[reward]] #2 judge.prompt: {root}/broken.jinja:1: not a Jinja template",
        ),
    ],
)
def test_a_bad_judge_is_one_line_before_any_compute(tmp_path, capsys, table, message):
    tokenizer = tmp_path / "tok"
    make_tokenizer(tokenizer)
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "judge.jinja").write_text(TEMPLATE)
    (tmp_path / "broken.jinja").write_text("{{ prompt ")
    config = write_config(tmp_path, str(tokenizer))
    with open(config, "a") as file:
        file.write(f"[[reward]]\njudge = {inline(table)}\n")
    assert message.format(root=tmp_path) in train(capsys, config)


def test_a_proxy_the_judge_cannot_speak_to_is_one_line(tmp_path, capsys, monkeypatch):
    """The environment's proxy for the judge's scheme must be plain HTTP (CONNECT for https)."""
    monkeypatch.setenv("HTTP_PROXY", "socks5://user:pw@egress.internal:1080")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    tokenizer = tmp_path / "tok"
    make_tokenizer(tokenizer)
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "judge.jinja").write_text(TEMPLATE)
    config = write_config(tmp_path, str(tokenizer))
    with open(config, "a") as file:
        file.write(f"[[reward]]\njudge = {inline(judge_table())}\n")
    assert (
        "[[reward]] #2 judge.base_url: proxy 'socks5://egress.internal:1080' is not an "
        "http://host:port proxy; allowed: an http:// proxy in HTTP_PROXY / HTTPS_PROXY, or the "
        "host in NO_PROXY"
    ) in train(capsys, config)


def test_a_judge_that_is_down_costs_bounded_tries_per_completion(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "judge.jinja").write_text(TEMPLATE)
    table = judge_table(base_url=f"http://127.0.0.1:{port}/v1", retries=1)
    config = config_from_dict(
        {"reward": [{"judge": table, "on_error": "zero", "timeout_s": 2.0}]},
        source=str(tmp_path / "run.toml"),
    )
    rewards = build_rewards(config)
    started = time.monotonic()
    scores = score(
        rewards,
        ["What is 2 + 3?"] * 3,
        ["5", "six", ""],
        [{"answer": "5"}] * 3,
        [f"train.jsonl:{i + 1}" for i in range(3)],
    )
    assert time.monotonic() - started < 10
    assert scores.per_reward["judge"].tolist() == [0.0, 0.0, 0.0] and scores.errors == 3
    assert scores.replies == {"judge": [None, None, None]}
    assert scores.messages[0].startswith(
        f"reward 'judge' (judge judge at http://127.0.0.1:{port}/v1) failed: POST "
        f"http://127.0.0.1:{port}/v1/chat/completions: ConnectionRefusedError: "
    )
    assert scores.messages[0].endswith("(2 tries) on train.jsonl:1")
