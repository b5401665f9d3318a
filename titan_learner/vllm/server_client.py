"""One `vllm serve` server, as the trainer talks to it over HTTP.

vLLM's four weight-sync calls (so a `ServerClient` is a `VLLMWeightSyncClient` that trainer
engines drive), pause/resume around an update, the version it serves, and token-in/token-out
generation: prompt ids in; sampled ids, their log-probs and the weight version that sampled
them out, never text (no retokenization). Every request carries the servers' bearer token
(`titan-learner serve` starts none without one). A server that cannot be reached, or answers
an error, is one `ServerError` naming it, the route and its answer.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 3600.0
"""How long one request may wait for its answer ([rollout.vllm] server_timeout_s): a prompt's
G long completions on a busy server take minutes, a large model's update too."""
ENGINE_ANSWER_S = 60.0
"""How long a server's engine may take to answer a read (its weight version) when a job
connects: one that does not is inside a call that never returned. A weight update whose trainer
died inside an nccl broadcast waits so for good, and each of the job's requests would wait out
server_timeout_s behind it."""
STUCK_ENGINE = (
    "{its} inside a call that has not returned, such as a weight update whose trainer died "
    "inside an nccl broadcast (NCCL waits for good); restart {that}"
)
DEFAULT_START_TIMEOUT_S = 600.0
"""How long a job that starts waits for servers not listening yet ([rollout.vllm]
server_start_timeout_s): a server started beside the job opens its port only once vLLM has
loaded the model (~30 s for the toy on 2 CPU cores, minutes for a large model on GPUs)."""
START_POLL_S = 1.0
HEALTH_ANSWER_S = 30.0
"""How long /health may take once a server listens (vLLM's API process answers it at once)."""
CONNECT_RETRIES = 3
"""Tries for a call that is safe to repeat (reads, generation, pause and resume) when the
server cannot be connected to; a server that stays down is then one ServerError."""
RESET_TRIES = 5
RESET_RETRY_S = 0.2
"""How often, and how far apart, a refused prefix-cache reset is tried again (vLLM refuses it
while blocks are held; an async KV offload lets go of them within moments)."""


class ServerError(RuntimeError):
    """A rollout server that is down, unreachable or refused a request (`status`: its HTTP
    status, where it answered; `timed_out`: it did not answer in time; `unreachable`: nothing
    accepted the connection; `closed`: something accepted it and closed it without an
    answer)."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        timed_out: bool = False,
        unreachable: bool = False,
        closed: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.timed_out = timed_out
        self.unreachable = unreachable
        self.closed = closed


def stuck_engines(urls: list[str]) -> ServerError:
    """The error for several servers whose engines did not answer a read within
    ENGINE_ANSWER_S (`ServerClient.check_engine_answers` names one)."""
    return ServerError(
        f"rollout servers {', '.join(urls)} did not answer GET /weight_info within "
        f"{ENGINE_ANSWER_S:g} s; "
        + STUCK_ENGINE.format(its="their engines are", that="those servers"),
        timed_out=True,
    )


def _closed_without_answer(err: Exception) -> bool:
    """Whether requests' ConnectionError is a peer that accepted the connection, then closed it
    without an HTTP answer (http:// to a TLS port), not one that refused it."""
    import http.client

    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, http.client.RemoteDisconnected | ConnectionResetError):
            return True
        inner = [a for a in getattr(cause, "args", ()) if isinstance(a, BaseException)]
        cause = getattr(cause, "reason", None) or (inner[-1] if inner else cause.__cause__)
    return False


def trusted_certificates() -> str | bool:
    """What a server's TLS certificate is checked against: requests' own variables
    (REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE), else OpenSSL's SSL_CERT_FILE, which the LLM judge's
    client reads too (requests alone would ignore it), else the public CAs certifi ships."""
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(name):
            return os.environ[name]
    return True


def tls_reason(err: Exception) -> str:
    """OpenSSL's own words from requests' nested SSLError (`certificate verify failed:
    self-signed certificate`), else its type."""
    found = re.search(r"\[SSL[^\]]*\] ([^(']*)", str(err))
    return found.group(1).strip() if found else type(err).__name__


class ServerClient:
    def __init__(self, url: str, *, token: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {token}"}

    def _call(
        self,
        method: str,
        route: str,
        *,
        retry: bool = True,
        timeout_s: float | None = None,
        after_timeout: str = "allowed: a longer [rollout.vllm] server_timeout_s",
        **kwargs: Any,
    ) -> Any:
        """`timeout_s`: this call's (default: the client's); `after_timeout`: what its timeout
        error says after the seconds."""
        import requests

        timeout = self.timeout_s if timeout_s is None else timeout_s
        headers = {**self._headers, **kwargs.pop("headers", {})}
        for attempt in range(1, CONNECT_RETRIES + 1):
            try:
                answer = requests.request(
                    method,
                    f"{self.url}/{route}",
                    headers=headers,
                    timeout=timeout,
                    verify=trusted_certificates(),
                    **kwargs,
                )
                break
            except requests.exceptions.SSLError as err:  # no try would do better
                raise ServerError(
                    f"rollout server {self.url}: TLS failed ({method} /{route}): "
                    f"{tls_reason(err)}; allowed: a certificate of a public CA, or "
                    "SSL_CERT_FILE (or REQUESTS_CA_BUNDLE) naming the PEM file of the CA that "
                    "signed it (of a self-signed certificate: the certificate itself)"
                ) from None
            except requests.ConnectionError as err:
                if retry and attempt < CONNECT_RETRIES:
                    time.sleep(attempt)
                    continue
                raise ServerError(
                    f"rollout server {self.url} is unreachable ({method} /{route}, "
                    f"{attempt} tries): {type(err).__name__}",
                    unreachable=True,
                    closed=_closed_without_answer(err),
                ) from None
            except requests.Timeout:
                raise ServerError(
                    f"rollout server {self.url} did not answer {method} /{route} within "
                    f"{timeout:g} s; {after_timeout}",
                    timed_out=True,
                ) from None
            except requests.RequestException as err:
                raise ServerError(
                    f"rollout server {self.url} did not answer {method} /{route}: "
                    f"{type(err).__name__}: {err}"
                ) from None
        if answer.status_code >= 400:
            raise ServerError(
                f"rollout server {self.url} answered {method} /{route} with "
                f"{answer.status_code}: {answer.text[:500]}",
                status=answer.status_code,
            )
        if not answer.content:
            return None
        try:
            return answer.json()
        except ValueError:  # vLLM's LoRA routes answer their outcome as plain text
            return answer.text

    def listening(self) -> bool:
        """Whether the server answers /health; False while nothing listens on its port (a
        server still loading its model). Any other failure is its ServerError."""
        try:
            self._call(
                "GET",
                "health",
                retry=False,
                timeout_s=min(self.timeout_s, HEALTH_ANSWER_S),
                after_timeout="a server that listens answers it at once: restart it",
            )
        except ServerError as err:
            if err.closed and self.url.startswith("http://"):
                raise ServerError(
                    f"rollout server {self.url} closed the connection without answering GET "
                    "/health: a server started with TLS (`titan-learner serve ... -- "
                    "--ssl-certfile ...`) answers at https:// only, and a server that is "
                    f"stopping answers nothing; allowed: {'https' + self.url[4:]} in "
                    "[rollout.vllm] servers for a TLS server, or restart it"
                ) from None
            if err.unreachable:
                return False
            raise
        return True

    # vLLM's weight-sync control plane (VLLMWeightSyncClient)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(
            "POST", "init_weight_transfer_engine", retry=False, json={"init_info": init_info}
        )

    def start_weight_update(self) -> None:
        self._call("POST", "start_weight_update", retry=False)

    def update_weights(self, update_info: Any) -> None:
        self._call("POST", "update_weights", retry=False, json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._call("POST", "finish_weight_update", retry=False, json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("POST", "shutdown_weight_transfer_engine", retry=False)

    # around an update
    def pause(self) -> None:
        """Freeze the queue (requests in flight and arriving wait, none is lost) for a swap."""
        self._call("POST", "pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._call("POST", "resume")

    def reset_prefix_cache(self) -> None:
        """After an update, so that no prompt reuses KV computed with the previous weights.
        vLLM answers `{"success": false}` while blocks are held (requests in flight, an async
        KV offload): tried RESET_TRIES times, RESET_RETRY_S apart, then one error."""
        for attempt in range(RESET_TRIES):
            if attempt:
                time.sleep(RESET_RETRY_S)
            answer = self._call("POST", "reset_prefix_cache")
            if not isinstance(answer, dict) or answer.get("success", True):
                return
        raise ServerError(
            f"rollout server {self.url} refused to reset its prefix cache after a weight update "
            f"({RESET_TRIES} tries, {RESET_RETRY_S:g} s apart: blocks still held, by requests "
            "the job did not send, as it leaves none in flight during a push); its cached KV "
            "would be of the previous weights: keep other clients off a run's servers"
        )

    def weight_version(self) -> str | None:
        return self._call("GET", "weight_info")["weight_version"]

    def set_weight_version(self, version: str) -> None:
        """The version the server labels its tokens with (what an update's finish sets)."""
        self._call("POST", "update_weight_version", json={"new_version": version})

    # a LoRA run's adapters (vllm.adapter_route; vLLM's own LoRA routes)
    def upload_adapter(self, name: str, safetensors: bytes, config: dict[str, Any]) -> None:
        """Send an adapter's files; the server writes them on its own host and loads them."""
        headers = {"X-Adapter-Config": json.dumps(config)}
        self._call("POST", f"titan_learner/lora_adapter/{name}", data=safetensors, headers=headers)

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters the server serves (its /v1/models beside the base)."""
        models = self._call("GET", "v1/models")["data"]
        return [m["id"] for m in models if m.get("parent") is not None]

    def unload_adapter(self, name: str) -> None:
        self._call("POST", "v1/unload_lora_adapter", json={"lora_name": name})

    def workers(self) -> int:
        """How many inference workers join a weight transfer (tensor x pipeline x data)."""
        return int(self._call("GET", "get_world_size")["world_size"])

    def served_config(self) -> dict[str, Any]:
        """The server's vLLM config as JSON (vLLM's dev-mode `/server_info`, which the RL
        routes need anyway): its weight-transfer backend and parallel layout."""
        try:
            answer = self._call("GET", "server_info", params={"config_format": "json"})
        except ServerError as err:
            if err.status != 404:
                raise
            raise ServerError(
                f"rollout server {self.url} has no vLLM RL routes (GET /server_info answered "
                "404): it was started without VLLM_SERVER_DEV_MODE=1; allowed: a server from "
                "titan-learner serve --config (which sets it and the rest the job needs)",
                status=404,
            ) from None
        return answer["vllm_config"]

    def check_engine_answers(self) -> None:
        """ServerError unless the engine answers a read within ENGINE_ANSWER_S (`/health` is
        the API process's answer alone, given while the engine is stuck)."""
        stuck = STUCK_ENGINE.format(its="its engine is", that="that server")
        self._call("GET", "weight_info", timeout_s=ENGINE_ANSWER_S, after_timeout=stuck)

    def generate(
        self, token_ids: list[int], sampling: dict[str, Any], adapter: str | None = None
    ) -> list[tuple[list[int], list[float], set[str]]]:
        """One token-in/token-out request (vLLM's /inference/v1/generate, `--enable-scale-out`):
        per sample, in index order, its token ids, their log-probs and the weight versions that
        sampled them (vLLM labels every output token with the version it was sampled under).
        `adapter`: the LoRA adapter (by name) to sample with."""
        request = {"token_ids": token_ids, "sampling_params": sampling, "output_mode": "tokens"}
        if adapter is not None:
            request["model"] = adapter
        answer = self._call("POST", "inference/v1/generate", json=request)
        samples = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            if choice.get("finish_reason") == "abort":
                raise ServerError(
                    f"rollout server {self.url} aborted a request of this step (it is shutting "
                    "down, or its /pause or /abort_requests was called without the job); "
                    "nothing of this step is trained: a cut completion would be trained as if "
                    "it were whole"
                )
            ids = [int(t) for t in choice["token_ids"]]
            log_probs = [
                float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []
            ]
            if len(log_probs) != len(ids):
                raise ServerError(
                    f"rollout server {self.url} returned {len(log_probs)} log-probs for "
                    f"{len(ids)} sampled tokens"
                )
            versions = {span["version"] for span in choice.get("weight_versions") or []}
            samples.append((ids, log_probs, versions))
        return samples


def wait_until_listening(
    servers: list[ServerClient], timeout_s: float, say: Callable[[str], None] | None = None
) -> None:
    """Return once every server answers /health, waiting up to `timeout_s` for the ones that
    nothing listens on yet (started beside the job, still loading); `say` (one rank's print)
    hears which it waits for and when they answer. A server that answers with an error is
    its ServerError at once; one still not listening after `timeout_s`, one line naming it."""
    start = time.monotonic()
    waiting = [server for server in servers if not server.listening()]
    if waiting and say is not None:
        names = ", ".join(server.url for server in waiting)
        say(f"waiting up to {timeout_s:g} s for rollout servers to listen: {names}")
    while waiting:
        if time.monotonic() - start >= timeout_s:
            names = ", ".join(server.url for server in waiting)
            raise ServerError(
                f"rollout servers {names} did not listen within {timeout_s:g} s of the job's "
                "start (GET /health: nothing accepts the connection); allowed: start them "
                "(titan-learner serve --config ...), or a longer [rollout.vllm] "
                "server_start_timeout_s",
                unreachable=True,
            )
        time.sleep(min(START_POLL_S, max(0.0, timeout_s - (time.monotonic() - start))))
        waiting = [server for server in waiting if not server.listening()]
        if not waiting and say is not None:
            say(f"rollout servers listen after {time.monotonic() - start:.0f} s")
