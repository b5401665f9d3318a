"""The gate before a push to shared rollout servers, on a real 2-process gloo world: rank 0
pushes only after every rank asked for the version, and a rank that never asks is one line."""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.worlds import run_world


def _gate_scenario(rank: int, root: str) -> dict:
    import torch.distributed as dist

    from titan_learner.model.parallelize import init_process_group
    from titan_learner.vllm.push_gate import trainer_push_gate
    from titan_learner.vllm.server_client import ServerError

    init_process_group("cpu")
    gate = trainer_push_gate()
    sampled = Path(root) / "rank1_sampled_version_0"
    seen = {}
    # Version 1, twice (a preemption's drain pushes a version the thread already asked for).
    for nth in range(2):
        if rank == 1:
            time.sleep(1.0)  # still sampling with version 0
            sampled.write_text(str(nth))
        keys = gate.arrive(1)
        if rank == 0:
            gate.wait_for_all(keys, 1)
            seen[nth] = sampled.read_text() if sampled.exists() else None
    dist.barrier()
    if rank == 0:
        short = type(gate)(gate.run_id, 0, 2, timeout_s=2.0)
        try:
            short.wait_for_all(short.arrive(7), 7)
        except ServerError as err:
            seen["refused"] = str(err)
    dist.barrier()
    return seen


def test_rank_0_pushes_only_after_every_rank_asked_and_a_missing_rank_is_one_line(tmp_path):
    results = run_world(2, _gate_scenario, str(tmp_path), timeout=120)
    assert results[0][0] == "0" and results[0][1] == "1", results[0]
    assert results[0]["refused"] == (
        "trainer ranks [1] did not finish sampling with the weights before version 7 within "
        "2 s; the push to the rollout servers waits for every rank"
    )
