"""A judge's `timeout_s` is a total deadline per request: a real local HTTP server that trickles
its reply a byte at a time (each byte well within timeout_s, so a per-operation socket timeout
never fires) is cut at the deadline, tried again `retries` times, and each completion is then
the error its reward's on_error says."""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from tests.support.servers import QuietHandler
from tests.unit.test_reward_judge import TEMPLATE, judge_table
from titan_learner.config.toml import config_from_dict
from titan_learner.rewards.runner import RewardError, build_rewards, score

TIMEOUT_S = 1.0
BYTE_EVERY_S = 0.05
REPLY = json.dumps({"choices": [{"message": {"content": "Score: 7"}}]}).encode()
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch):
    """The judge honours the proxy variables: a machine's own would send these local requests
    elsewhere. A test sets the ones it means."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


class Trickle(QuietHandler):
    """A chat completion, sent a byte every `server.byte_every_s` seconds (status line and
    headers too when `server.trickle_headers`)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.requests += 1
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(REPLY)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            if not self.server.trickle_headers:
                self.wfile.write(head)
                self.wfile.flush()
                head = b""
            for i in range(len(head + REPLY)):
                self.wfile.write((head + REPLY)[i : i + 1])
                self.wfile.flush()
                time.sleep(self.server.byte_every_s)
        except OSError:
            pass  # the judge cut the request at its deadline


@contextlib.contextmanager
def judge_server(tls: ssl.SSLContext | None = None) -> Iterator[ThreadingHTTPServer]:
    """A Trickle server on a local port, in a thread (over TLS with a `tls` context)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    server.lock, server.requests = threading.Lock(), 0
    server.byte_every_s, server.trickle_headers = BYTE_EVERY_S, False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def trickling():
    with judge_server() as server:
        yield server


def base_url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_port}/v1"


def judge_rewards(tmp_path, url: str, on_error: str):
    """One judge reward at `url` (its base_url), one retry, TIMEOUT_S a request."""
    (tmp_path / "judge.jinja").write_text(TEMPLATE)
    table = judge_table(base_url=url, retries=1)
    config = config_from_dict(
        {"reward": [{"judge": table, "on_error": on_error, "timeout_s": TIMEOUT_S}]},
        source=str(tmp_path / "run.toml"),
    )
    return build_rewards(config)


def judged(rewards, completions: int = 2):
    return score(
        rewards,
        ["What is 2 + 3?"] * completions,
        ["5"] * completions,
        [{"answer": "5"}] * completions,
        [f"train.jsonl:{i + 1}" for i in range(completions)],
    )


def timed_out(server: ThreadingHTTPServer, via: str = "") -> str:
    """The one line the docs promise: what timed out (`via` a proxy), after how many tries, on
    which row."""
    url = base_url(server)
    return (
        f"reward 'judge' (judge judge at {url}) failed: POST {url}/chat/completions{via}: "
        f"TimeoutError: no whole reply in {TIMEOUT_S:g} s (2 tries) on train.jsonl:1"
    )


def test_a_reply_within_the_deadline_scores(tmp_path, trickling):
    trickling.byte_every_s = 0.0
    scores = judged(judge_rewards(tmp_path, base_url(trickling), "raise"))
    assert scores.per_reward["judge"].tolist() == [7.0, 7.0] and scores.errors == 0
    assert trickling.requests == 2


@pytest.mark.parametrize("trickle_headers", [False, True], ids=["body", "headers"])
def test_a_trickled_reply_is_cut_at_the_deadline_and_tried_again(
    tmp_path, trickling, trickle_headers
):
    trickling.trickle_headers = trickle_headers
    assert len(REPLY) * BYTE_EVERY_S > 2 * TIMEOUT_S  # whole, the reply would take longer
    rewards = judge_rewards(tmp_path, base_url(trickling), "zero")
    started = time.monotonic()
    scores = judged(rewards)
    seconds = time.monotonic() - started
    # two tries of TIMEOUT_S each and one backoff (0.5 s), the completions concurrently
    assert 2 * TIMEOUT_S + 0.5 <= seconds < 2 * TIMEOUT_S + 0.5 + 1.5
    assert trickling.requests == 4
    assert scores.per_reward["judge"].tolist() == [0.0, 0.0] and scores.errors == 2
    assert scores.replies == {"judge": [None, None]}
    assert scores.messages[0] == timed_out(trickling)


def test_a_trickled_reply_under_on_error_raise_is_one_line(tmp_path, trickling):
    rewards = judge_rewards(tmp_path, base_url(trickling), "raise")
    with pytest.raises(RewardError) as raised:
        judged(rewards, completions=1)
    assert (
        str(raised.value)
        == timed_out(trickling) + '; allowed: a finite number (or on_error = "zero")'
    )
