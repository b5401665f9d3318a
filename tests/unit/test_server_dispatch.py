"""Which rollout server samples each prompt (titan_learner.vllm.server_dispatch), with real
threads: round-robin from a rank's own start while every prompt is in flight, more prompts to a
faster server once the cap binds, results in prompt order, and nothing more sent after an
error. The servers themselves: tests/integration/test_rollout_servers.py."""

from __future__ import annotations

import threading
import time

import pytest

from titan_learner.vllm.server_dispatch import prompts_in_flight, sample_on_servers


def test_prompts_all_in_flight_go_round_robin_from_the_ranks_start():
    """Nothing finishes before every prompt is sent: the spread is even, from `first`."""
    sent = threading.Barrier(10, timeout=30)
    chosen: dict[int, int] = {}

    def sample(prompt: int, server: int) -> int:
        chosen[prompt] = server
        sent.wait()  # every prompt is in flight before any answers
        return prompt * 10

    results = sample_on_servers(10, 3, first=7, sample=sample, in_flight_per_server=4)
    assert results == [p * 10 for p in range(10)]
    counts = [list(chosen.values()).count(s) for s in range(3)]
    assert sorted(counts) == [3, 3, 4] and counts[7 % 3] == 4  # round-robin from server 1


def test_a_faster_server_takes_more_prompts_once_the_cap_binds():
    """Two prompts in flight per server: the slow server (200 ms a prompt) keeps its two, the
    fast one (1 ms) takes the rest. A static round-robin would give each half of the 60, and
    the step would end at the slow server's pace."""
    seconds = {0: 0.2, 1: 0.001}
    chosen: list[int] = []

    def sample(prompt: int, server: int) -> int:
        chosen.append(server)
        time.sleep(seconds[server])
        return prompt

    results = sample_on_servers(60, 2, first=0, sample=sample, in_flight_per_server=2)
    assert results == list(range(60))
    assert chosen.count(0) < 10, chosen  # round-robin: 30


def test_an_error_stops_the_sends_and_is_what_raises():
    """A dead server fails every prompt sent to it: after the first failure nothing queued is
    sent, and that failure is the error (not a cancellation)."""
    attempted: list[int] = []

    def sample(prompt: int, server: int) -> int:
        attempted.append(prompt)
        time.sleep(0.02)  # a refused connection, after its retries
        if server == 1:
            raise ConnectionError(f"server {server} is down")
        return prompt

    with pytest.raises(ConnectionError, match=r"^server 1 is down$"):
        sample_on_servers(200, 2, first=0, sample=sample, in_flight_per_server=1)
    assert len(attempted) < 20, attempted  # all 200 before


def test_more_servers_keep_more_prompts_in_flight():
    """The cap is per server: 3 servers at 2 each hold 6 prompts at once, not 2."""
    in_flight, most = 0, 0
    lock = threading.Lock()

    def sample(prompt: int, server: int) -> int:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.02)
        with lock:
            in_flight -= 1
        return prompt

    sample_on_servers(24, 3, first=0, sample=sample, in_flight_per_server=2)
    assert most == 6


def test_a_server_gets_twice_the_sequences_vllm_schedules_at_once():
    """vLLM 0.32 schedules up to 1024 sequences at once on an H100 or H200 (max_num_seqs)."""
    assert [prompts_in_flight(g) for g in (1, 8, 16, 64, 4096)] == [2048, 256, 128, 32, 1]
