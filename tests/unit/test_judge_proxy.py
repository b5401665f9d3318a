"""The judge honours the proxy variables as urllib does, within its total deadline.

A real forwarding proxy in a thread (stdlib socketserver), in front of test_judge_deadline's
local judge server, records every request head it receives: an http judge is sent to it with
the absolute URL and the proxy's credentials, NO_PROXY bypasses it, a proxy that trickles is cut
at the deadline; an https judge (a self-signed certificate the test trusts through
SSL_CERT_FILE) goes through a CONNECT tunnel, and a refused tunnel is one line.
"""

from __future__ import annotations

import base64
import select
import socket
import socketserver
import ssl
import threading
import time
import urllib.parse
from http.server import ThreadingHTTPServer

import pytest

from tests.support.tls import self_signed
from tests.unit.test_judge_deadline import (
    BYTE_EVERY_S,
    PROXY_VARIABLES,
    TIMEOUT_S,
    base_url,
    judge_rewards,
    judge_server,
    judged,
    timed_out,
)
from titan_learner.rewards.proxy_route import Proxy, proxy_for

CREDENTIALS = ("judge", "s@cret:1")
BASIC = "Basic " + base64.b64encode(":".join(CREDENTIALS).encode()).decode()


class Forwarding(socketserver.StreamRequestHandler):
    """Records the request head; CONNECT: answers `server.connect_status` (200: then relays
    bytes both ways); otherwise forwards the request to its absolute URL's host and relays the
    reply. With `server.byte_every_s`, the reply (the tunnel's: its head) a byte at a time."""

    def handle(self) -> None:
        head = []
        while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
            head.append(line.decode().rstrip("\r\n"))
        if not head:
            return
        with self.server.lock:
            self.server.received.append(head)
        method, target, _ = head[0].split(" ", 2)
        if method == "CONNECT":
            self.tunnel(target)
        else:
            self.forward(target, head[1:])

    def forward(self, url: str, headers: list[str]) -> None:
        length = next(
            int(h.split(":", 1)[1]) for h in headers if h.lower().startswith("content-length:")
        )
        body = self.rfile.read(length)
        kept = [h for h in headers if not h.lower().startswith("proxy-authorization:")]
        parts = urllib.parse.urlsplit(url)
        request = "\r\n".join([f"POST {parts.path} HTTP/1.1", *kept, "", ""]).encode() + body
        with socket.create_connection((parts.hostname, parts.port)) as upstream:
            upstream.sendall(request)
            try:
                while chunk := upstream.recv(1 if self.server.byte_every_s else 65536):
                    self.wfile.write(chunk)
                    time.sleep(self.server.byte_every_s)
            except OSError:
                pass  # the judge cut the request at its deadline

    def tunnel(self, target: str) -> None:
        if self.server.connect_status != 200:
            self.wfile.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        host, port = target.rsplit(":", 1)
        head = b"HTTP/1.1 200 Connection established\r\nX-Padding: " + b"." * 60 + b"\r\n\r\n"
        with socket.create_connection((host, int(port))) as upstream:
            try:
                for i in range(len(head)):
                    self.wfile.write(head[i : i + 1])
                    time.sleep(self.server.byte_every_s)
                self.relay(upstream)
            except OSError:
                pass  # the judge cut the request at its deadline

    def relay(self, upstream: socket.socket) -> None:
        """Bytes both ways until either end closes (or is quiet for 5 s)."""
        ends = {self.connection: upstream, upstream: self.connection}
        while readable := select.select(list(ends), [], [], 5.0)[0]:
            for end in readable:
                data = end.recv(65536)
                if not data:
                    return
                ends[end].sendall(data)


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch):
    """Only the proxy variables a test sets."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def judge():
    """test_judge_deadline's judge server, replying at once."""
    with judge_server() as server:
        server.byte_every_s = 0.0
        yield server


@pytest.fixture
def proxy():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Forwarding)
    server.daemon_threads = True
    server.lock, server.received = threading.Lock(), []
    server.byte_every_s, server.connect_status = 0.0, 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def proxy_url(server: socketserver.TCPServer, credentials: bool = False) -> str:
    user = ":".join(urllib.parse.quote(part, safe="") for part in CREDENTIALS) + "@"
    return f"http://{user if credentials else ''}127.0.0.1:{server.server_address[1]}"


def via(server: socketserver.TCPServer) -> str:
    return f" via proxy 127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy"])
def test_an_http_judge_goes_through_the_proxy_with_its_credentials(
    tmp_path, monkeypatch, judge, proxy, variable
):
    monkeypatch.setenv(variable, proxy_url(proxy, credentials=True))
    scores = judged(judge_rewards(tmp_path, base_url(judge), "raise"))
    assert scores.per_reward["judge"].tolist() == [7.0, 7.0] and scores.errors == 0
    assert judge.requests == 2
    assert [head[0] for head in proxy.received] == [
        f"POST {base_url(judge)}/chat/completions HTTP/1.1"
    ] * 2
    assert all(f"Proxy-Authorization: {BASIC}" in head for head in proxy.received)


def test_no_proxy_naming_the_host_bypasses_the_proxy(tmp_path, monkeypatch, judge, proxy):
    monkeypatch.setenv("HTTP_PROXY", proxy_url(proxy))
    monkeypatch.setenv("NO_PROXY", "judge.example.com,127.0.0.1")
    scores = judged(judge_rewards(tmp_path, base_url(judge), "raise"))
    assert scores.per_reward["judge"].tolist() == [7.0, 7.0] and judge.requests == 2
    assert proxy.received == []


def test_a_trickling_proxy_is_cut_at_the_deadline(tmp_path, monkeypatch, judge, proxy):
    monkeypatch.setenv("HTTP_PROXY", proxy_url(proxy))
    proxy.byte_every_s = BYTE_EVERY_S
    rewards = judge_rewards(tmp_path, base_url(judge), "zero")
    started = time.monotonic()
    scores = judged(rewards)
    seconds = time.monotonic() - started
    # two tries of TIMEOUT_S each and one backoff (0.5 s), the completions concurrently
    assert 2 * TIMEOUT_S + 0.5 <= seconds < 2 * TIMEOUT_S + 0.5 + 1.5
    assert len(proxy.received) == 4 and scores.errors == 2
    assert scores.messages[0] == timed_out(judge, via(proxy))


@pytest.fixture
def tls_judge(tmp_path, monkeypatch):
    """test_judge_deadline's judge server over TLS, its certificate trusted (SSL_CERT_FILE)."""
    cert_file, key_file = self_signed(tmp_path, "judge")
    monkeypatch.setenv("SSL_CERT_FILE", cert_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    with judge_server(context) as server:
        server.byte_every_s = 0.0
        yield server


def https_url(server: ThreadingHTTPServer) -> str:
    return f"https://127.0.0.1:{server.server_port}/v1"


def test_an_https_judge_goes_through_a_connect_tunnel(tmp_path, monkeypatch, tls_judge, proxy):
    monkeypatch.setenv("HTTPS_PROXY", proxy_url(proxy, credentials=True))
    scores = judged(judge_rewards(tmp_path, https_url(tls_judge), "raise"))
    assert scores.per_reward["judge"].tolist() == [7.0, 7.0] and tls_judge.requests == 2
    assert len(proxy.received) == 2
    for head in proxy.received:
        assert head[0].startswith(f"CONNECT 127.0.0.1:{tls_judge.server_port} HTTP/1.")
        assert f"Proxy-Authorization: {BASIC}" in head


def test_a_proxy_trickling_its_tunnel_is_cut_at_the_deadline(
    tmp_path, monkeypatch, tls_judge, proxy
):
    """The deadline covers the CONNECT leg: the watchdog holds the socket from TCP connect on."""
    monkeypatch.setenv("HTTPS_PROXY", proxy_url(proxy))
    proxy.byte_every_s = BYTE_EVERY_S
    rewards = judge_rewards(tmp_path, https_url(tls_judge), "zero")
    started = time.monotonic()
    scores = judged(rewards, completions=1)
    seconds = time.monotonic() - started
    assert 2 * TIMEOUT_S + 0.5 <= seconds < 2 * TIMEOUT_S + 0.5 + 1.5
    url = https_url(tls_judge)
    assert scores.messages[0] == (
        f"reward 'judge' (judge judge at {url}) failed: POST {url}/chat/completions"
        f"{via(proxy)}: TimeoutError: no whole reply in {TIMEOUT_S:g} s (2 tries) "
        "on train.jsonl:1"
    )
    assert tls_judge.requests == 0


def test_a_refused_tunnel_is_one_line(tmp_path, monkeypatch, tls_judge, proxy):
    monkeypatch.setenv("HTTPS_PROXY", proxy_url(proxy))
    proxy.connect_status = 502
    scores = judged(judge_rewards(tmp_path, https_url(tls_judge), "zero"), completions=1)
    url = https_url(tls_judge)
    assert scores.messages[0] == (
        f"reward 'judge' (judge judge at {url}) failed: POST {url}/chat/completions"
        f"{via(proxy)}: OSError: Tunnel connection failed: 502 Bad Gateway (2 tries) "
        "on train.jsonl:1"
    )
    assert len(proxy.received) == 2 and tls_judge.requests == 0


def test_an_ipv6_judge_host_is_bracketed_in_the_connect_line(tmp_path, monkeypatch, proxy):
    """Python 3.11's http.client writes `CONNECT fd00::7:8443`, which no proxy can parse."""
    monkeypatch.setenv("HTTPS_PROXY", proxy_url(proxy))
    proxy.connect_status = 502
    url = "https://[fd00::7]:8443/v1"
    scores = judged(judge_rewards(tmp_path, url, "zero"), completions=1)
    assert [head[0] for head in proxy.received] == ["CONNECT [fd00::7]:8443 HTTP/1.0"] * 2
    assert scores.messages[0] == (
        f"reward 'judge' (judge judge at {url}) failed: POST {url}/chat/completions"
        f"{via(proxy)}: OSError: Tunnel connection failed: 502 Bad Gateway (2 tries) "
        "on train.jsonl:1"
    )


def test_proxy_for_reads_the_variables_as_urllib_does(monkeypatch):
    monkeypatch.setenv("https_proxy", "egress.internal:3128")
    monkeypatch.setenv("no_proxy", ".corp.example")
    assert proxy_for("https://judge.example.org/v1") == Proxy("egress.internal", 3128)
    assert proxy_for("https://judge.corp.example/v1") is None
    assert proxy_for("http://judge.example.org/v1") is None  # no http proxy set
    monkeypatch.setenv("https_proxy", "socks5://user:pw@egress.internal:1080")
    with pytest.raises(ValueError, match=r"^proxy 'socks5://egress.internal:1080' is not an"):
        proxy_for("https://judge.example.org/v1")
