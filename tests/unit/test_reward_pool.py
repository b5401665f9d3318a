"""Rule rewards and user functions over worker processes: the same scores as in this process,
a hung call stopped (its worker replaced) without holding up the rest, a dead worker reported
on its row, a function that cannot be pickled kept in this process and said once, workers that
take SIGTERM from the job alone and end when the job is killed; and the running normalizer's
statistics."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch

from tests.support.processes import running
from titan_learner.config.toml import config_from_dict
from titan_learner.rewards.normalize import RunningNorm
from titan_learner.rewards.runner import build_rewards, close_rewards, score

ANSWERS = ["72", "5", "0.5", "1,234", "18"]
COMPLETIONS = [
    "She sold 48 / 2 = 24 in May, so \\boxed{72}.",
    "2 + 3 = 5",
    "\\boxed{\\frac{1}{2}}",
    "about 1234 apples",
    "nine and nine make 19",
    "no number at all",
    "\\boxed{72.0}",
] * 6


def rewards_of(tmp_path, tables):
    said = []
    config = config_from_dict({"reward": tables}, source=str(tmp_path / "run.toml"))
    return build_rewards(config, say=said.append), said


def run_score(rewards, completions=COMPLETIONS):
    rows = [{"answer": ANSWERS[i % len(ANSWERS)]} for i in range(len(completions))]
    origins = [f"train.jsonl:{i + 1}" for i in range(len(completions))]
    return score(rewards, ["p"] * len(completions), completions, rows, origins)


def test_two_workers_score_as_one_and_as_this_process(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def score(prompt, completion, row):\n    return len(completion) / 100\n"
    )
    totals, maths = [], []
    for workers in (0, 1, 2):
        tables = [
            {"function": "math", "workers": workers},
            {"function": "mine.py:score", "workers": workers, "weight": 0.5},
        ]
        rewards, said = rewards_of(tmp_path, tables)
        assert said == [] and all((r.pool is None) == (workers == 0) for r in rewards)
        try:
            scores = run_score(rewards)
        finally:
            close_rewards(rewards)
        totals.append(scores.total)
        maths.append(scores.per_reward["math"])
    assert torch.equal(totals[0], totals[1]) and torch.equal(totals[0], totals[2])
    assert maths[2][:7].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    lengths = torch.tensor([len(c) / 100 for c in COMPLETIONS])
    assert torch.allclose(totals[2], maths[2] + 0.5 * lengths)


def test_a_hung_call_times_out_its_worker_is_replaced_and_the_rest_scores(tmp_path):
    (tmp_path / "slow.py").write_text(
        "import time\n"
        "def score(prompt, completion, row):\n"
        "    if 'hang' in completion:\n"
        "        time.sleep(600)\n"
        "    return 1.0\n"
    )
    tables = [{"function": "slow.py:score", "workers": 2, "timeout_s": 1.0, "on_error": "zero"}]
    rewards, _ = rewards_of(tmp_path, tables)
    completions = ["a", "b", "hang here", "c", "d", "e", "hang again", "f"]
    try:
        run_score(rewards, ["warm"])  # the workers start outside the clock
        started = time.monotonic()
        scores = run_score(rewards, completions)
        elapsed = time.monotonic() - started
        assert scores.per_reward["score"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
        assert scores.errors == 2 and elapsed < 30
        assert scores.messages[0] == (
            "reward 'score' (slow.py:score) timed out: no result after 1 s on train.jsonl:3"
        )
        assert run_score(rewards, ["after"]).per_reward["score"].tolist() == [1.0]
    finally:
        close_rewards(rewards)


def test_a_worker_that_dies_fails_its_row_only(tmp_path):
    (tmp_path / "crash.py").write_text(
        "import os\n"
        "def score(prompt, completion, row):\n"
        "    if completion == 'crash':\n"
        "        os._exit(3)\n"
        "    return 0.5\n"
    )
    tables = [{"function": "crash.py:score", "workers": 1, "on_error": "zero"}]
    rewards, _ = rewards_of(tmp_path, tables)
    try:
        scores = run_score(rewards, ["x", "crash", "y"])
    finally:
        close_rewards(rewards)
    assert scores.per_reward["score"].tolist() == [0.5, 0.0, 0.5]
    assert scores.messages == [
        "reward 'score' (crash.py:score) raised (the worker process died (exit code 3)) on "
        "train.jsonl:2"
    ]


def test_a_function_that_cannot_be_pickled_runs_here_said_once(tmp_path):
    (tmp_path / "lam.py").write_text("score = lambda prompt, completion, row: 2.0\n")
    rewards, said = rewards_of(tmp_path, [{"function": "lam.py:score", "name": "lam"}])
    assert rewards[0].pool is None
    assert said == [
        "reward 'lam' (lam.py:score) cannot be pickled for worker processes: it runs in this "
        "process, one completion at a time"
    ]
    assert run_score(rewards, ["a", "b"]).total.tolist() == [2.0, 2.0]


def test_running_statistics_are_those_of_every_score_so_far():
    norm, seen = RunningNorm(), []
    generator = torch.Generator().manual_seed(0)
    for size in (3, 17, 1, 40):
        batch = (torch.randn(size, generator=generator, dtype=torch.float64) * 3 + 2).tolist()
        norm.update(batch)
        seen += batch
        reference = torch.tensor(seen, dtype=torch.float64)
        assert abs(norm.mean - float(reference.mean())) < 1e-9
        assert abs(norm.std - float(reference.std(unbiased=False))) < 1e-9
    values = torch.tensor([2.0, 5.0])
    expected = (values - float(reference.mean())) / float(reference.std(unbiased=False))
    assert torch.allclose(norm.apply(values), expected.float())
    restored = RunningNorm()
    restored.load_state_dict(norm.state_dict())
    assert torch.equal(restored.apply(values), norm.apply(values))


def test_a_pool_dropped_without_close_stops_its_workers(tmp_path):
    import gc

    rewards, _ = rewards_of(tmp_path, [{"function": "math", "workers": 2}])
    run_score(rewards, ["\\boxed{72}", "5"])
    processes = [worker.process for worker in rewards[0].pool.workers]
    assert all(p.is_alive() for p in processes)
    del rewards
    gc.collect()
    assert not any(p.is_alive() for p in processes)


def test_workers_take_sigterm_from_the_job_alone(tmp_path):
    """Slurm's SIGTERM reaches every process of the job step, Ctrl-C every process of the
    terminal's group: the workers ignore both (the job is finishing its step and needs them),
    and still end on the job's own SIGTERM (multiprocessing's terminate at the job's exit)."""
    rewards, _ = rewards_of(tmp_path, [{"function": "math", "workers": 2}])
    try:
        before = run_score(rewards).total
        processes = [worker.process for worker in rewards[0].pool.workers]
        pids = [str(p.pid) for p in processes]
        for name in ("TERM", "INT", "TERM"):  # sent by another process, as slurmstepd does
            subprocess.run(["kill", f"-{name}", *pids], check=True)
        time.sleep(1.0)
        assert all(p.is_alive() for p in processes)
        assert torch.equal(run_score(rewards).total, before)
        processes[0].terminate()  # SIGTERM from the job
        processes[0].join(timeout=10)
        assert processes[0].exitcode is not None and processes[1].is_alive()
    finally:
        close_rewards(rewards)


def test_workers_end_when_the_job_is_killed(tmp_path):
    """A job killed outright (SIGKILL, the OOM killer) leaves no reward worker behind."""
    job = textwrap.dedent(
        f"""
        import sys, time
        from titan_learner.config.toml import config_from_dict
        from titan_learner.rewards.runner import build_rewards, score
        config = config_from_dict({{"reward": [{{"function": "math", "workers": 2}}]}},
                                  source={str(tmp_path / "run.toml")!r})
        [reward] = build_rewards(config, say=print)
        score([reward], ["p"], ["\\boxed{{72}}"], [{{"answer": "72"}}], ["t:1"])
        print(*[w.process.pid for w in reward.pool.workers], flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", job], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in process.stdout.readline().split()]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids)
