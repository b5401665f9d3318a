"""The bearer-token guard of a rollout server: every route but /health, in constant time.

vLLM's own `--api-key` guards only its inference paths (/v1, ...); with `VLLM_SERVER_DEV_MODE`
the routes that pause a server, point its weight transfer at another rendezvous, load weights
or call worker methods answer anyone who reaches the port. `titan-learner serve` installs this
ASGI middleware with vLLM's `--middleware` option; the token comes from the server process's
environment (`TITAN_LEARNER_SERVER_TOKEN`), never from its command line, where `ps` shows it.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

TOKEN_ENV = "TITAN_LEARNER_SERVER_TOKEN"
OPEN_PATHS = frozenset({"/health"})
MIDDLEWARE = f"{__name__}.BearerTokenMiddleware"


class BearerTokenMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        token = os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{TOKEN_ENV} is not set: the server would answer anyone")
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "missing or wrong bearer token"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
