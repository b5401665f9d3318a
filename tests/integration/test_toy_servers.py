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
from tests.support.tls import self_signed
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


def test_a_server_over_tls_with_its_access_log_off_takes_the_job_at_its_https_url(tmp_path):
    """`serve ... -- --ssl-keyfile K --ssl-certfile C --disable-uvicorn-access-log`: vLLM's
    own front-end flags. The job reaches the server at https:// once it trusts the certificate
    (SSL_CERT_FILE), so the token no longer crosses the network in clear; without that
    trust it stops at once with OpenSSL's reason."""
    certificate, key = self_signed(tmp_path, "server")
    url = f"https://127.0.0.1:{free_port()}"
    sets = ["--set", f'rollout.vllm.servers=["{url}"]']
    env = {"TITAN_LEARNER_SERVER_TOKEN": TOKEN, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    log = tmp_path / "server.log"
    serve = [sys.executable, "-m", "titan_learner", "serve", "--config", CONFIG, *sets]
    front = ["--ssl-keyfile", key, "--ssl-certfile", certificate, "--disable-uvicorn-access-log"]
    server = start_logged([*serve, "--port", url.rsplit(":", 1)[1], "--", *front], log, env, REPO)
    out = tmp_path / "run"
    train = [sys.executable, "-m", "titan_learner", "train", "--config", CONFIG, *sets]
    for pair in ("run.steps=2", f'run.output_dir="{out}"', "eval.every_steps=0"):
        train += ["--set", pair]
    bundles = ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")  # a machine's own
    untrusted = {k: v for k, v in {**os.environ, **env}.items() if k not in bundles}
    trusted = {**untrusted, "SSL_CERT_FILE": certificate}
    try:
        with pytest.MonkeyPatch.context() as patch:  # this process polls /health over TLS too
            patch.setenv("REQUESTS_CA_BUNDLE", certificate)  # requests' own, as the tests' poll is
            wait_until_healthy([url], [server], [log])
        refused, done = (
            subprocess.run(
                train, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600
            )
            for environment in (untrusted, trusted)
        )
    finally:
        stop([server])
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: rollout server {url}: TLS failed (GET /health): certificate verify failed: "
        "self-signed certificate; allowed: a certificate of a public CA, or SSL_CERT_FILE (or "
        "REQUESTS_CA_BUNDLE) naming the PEM file of the CA that signed it (of a self-signed "
        "certificate: the certificate itself)"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "training/logprob_mismatch_max" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["training/logprob_mismatch_max"] <= 1e-5 for r in steps), steps
    assert '"POST /inference/v1/generate HTTP/1.1" 200' not in log.read_text()
