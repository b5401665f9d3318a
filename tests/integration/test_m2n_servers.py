"""`weight_transfer = "nccl_m2n"` end to end: a `titan-learner serve` server on GPU 1, the job on
GPU 0 sending its shards through vLLM's m2n engines, the server serving exactly the learner's
weights after every update (fp32 log-probs of its samples within 1e-5 of the learner's).

It needs 2 CUDA devices (NCCL takes one rank per device), vLLM built for CUDA and NVIDIA's
nccl-extensions (`nccl.m2n`); everywhere else it is skipped, saying which is missing. The CPU
tests of the pieces: tests/integration/test_local_shards.py, tests/unit/test_m2n_transfer.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

from tests.support.servers import free_port, start_logged, stop, wait_until_healthy
from tests.support.vllm import vllm_job_config, write_vllm_job_files
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.job.grpo import run


def _missing() -> str | None:
    if torch.cuda.device_count() < 2:
        return "needs 2 CUDA devices: NCCL takes one rank per device"
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:
        return "NVIDIA's nccl-extensions (nccl.m2n) does not import"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]
TOKEN = "test-token-not-a-secret"


def m2n_job(rank: int, source: str, tables: dict) -> list[dict]:
    os.environ["TITAN_LEARNER_SERVER_TOKEN"] = TOKEN
    return run(config_from_dict(tables, source))


def test_the_job_sends_its_shards_through_vllms_m2n_engine_and_the_server_serves_them(tmp_path):
    model = write_vllm_job_files(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"
    tables = vllm_job_config(
        tmp_path, model, steps=3, vllm={"servers": [url], "weight_transfer": "nccl_m2n"}
    )
    config = config_from_dict(tables, str(tmp_path / "run.toml"))
    (tmp_path / "run.toml").write_text(config_to_toml(config))
    log = tmp_path / "server.log"
    serve = ["-m", "titan_learner", "serve", "--config", "run.toml", "--gpus", "1"]
    server = start_logged(
        [sys.executable, *serve, "--port", url.rsplit(":", 1)[1]],
        log,
        {"TITAN_LEARNER_SERVER_TOKEN": TOKEN},
        cwd=tmp_path,
    )
    try:
        wait_until_healthy([url], [server], [log])
        [history] = run_world(1, m2n_job, str(tmp_path / "run.toml"), tables)  # on cuda:0
    finally:
        stop([server])
    assert [int(m["policy_version"]) for m in history] == [1, 2, 3]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert metrics["logprob_mismatch_max"] < 1e-5, metrics  # fp32: the server's = ours
