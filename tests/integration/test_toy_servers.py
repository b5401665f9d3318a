"""The embedded default on a rollout server, run as configs/toy_grpo_servers.toml tells a user to:
`titan-learner serve --config configs/toy_grpo_servers.toml` in a session of its own, then
`python -m titan_learner train --config configs/toy_grpo_servers.toml`, with the same token (the
port moved to a free one, the run short). Its model is built from scratch, so the server starts
from the learner's config.json on vLLM's dummy weights: an fp32 log-prob mismatch within 1e-5
on every step, the first included, says that it sampled with the learner's own weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import free_port, start_logged, stop, wait_until_healthy
from tests.support.vllm import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/toy_grpo_servers.toml"
TOKEN = "test-token-not-a-secret"


def test_the_embedded_default_trains_on_a_server_started_from_its_config_alone(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    sets = ["--set", f'rollout.vllm.servers=["{url}"]']
    env = {"TITAN_LEARNER_SERVER_TOKEN": TOKEN, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    log = tmp_path / "server.log"
    serve = [sys.executable, "-m", "titan_learner", "serve", "--config", CONFIG, *sets]
    server = start_logged([*serve, "--port", url.rsplit(":", 1)[1]], log, env, cwd=REPO)
    try:
        wait_until_healthy([url], [server], [log])
        out = tmp_path / "run"
        train = [sys.executable, "-m", "titan_learner", "train", "--config", CONFIG, *sets]
        for pair in ("run.steps=3", f'run.output_dir="{out}"', "eval.every_steps=2"):
            train += ["--set", pair]
        done = subprocess.run(
            [*train, "--set", "eval.max_prompts=8"],
            cwd=REPO,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stop([server])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    served = log.read_text()
    assert "load_format=dummy" in served, "the server started on placeholder weights"
    assert "Failed to load weights" not in served, "vLLM's rotary warning, once per update"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "training/logprob_mismatch_max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["training/logprob_mismatch_max"] <= 1e-5 for r in steps), steps
    evaluated = [r["step"] for r in records if "eval/reward_mean" in r]
    assert evaluated == [0, 2, 3], "evaluation samples on the server too"
