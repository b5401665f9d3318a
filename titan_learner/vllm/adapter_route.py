"""A rollout server's route for a LoRA run's adapters (`[model.lora] push = "adapter"`), with no
filesystem shared with the trainer.

vLLM loads a LoRA adapter from a directory on the server's own host (`/v1/load_lora_adapter`
with `lora_path`). `titan-learner serve` installs this ASGI middleware inside the bearer-token
guard (so it answers only the run's token): `POST /titan_learner/lora_adapter/<name>` carries the
adapter's safetensors file as its body and its adapter_config.json in the `X-Adapter-Config`
header; the middleware writes both to a directory of this server (in /dev/shm where it can),
then hands vLLM's own load route that directory, and answers what vLLM answers. The adapters of
other names are removed from disk once the new one is loaded (vLLM holds them in memory).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from titan_learner.vllm.lora_adapters import memory_dir

PREFIX = "/titan_learner/lora_adapter/"
CONFIG_HEADER = b"x-adapter-config"
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
MIDDLEWARE = f"{__name__}.AdapterUploadMiddleware"


class AdapterUploadMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.root = Path(tempfile.mkdtemp(prefix="titan_learner_served_", dir=memory_dir()))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(PREFIX) or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        name = path[len(PREFIX) :]
        config = dict(scope.get("headers") or ()).get(CONFIG_HEADER)
        if not NAME.fullmatch(name) or config is None or not _is_json(config):
            await _answer(
                send, 400, {"error": f"expected {PREFIX}<name> and a JSON {CONFIG_HEADER!r}"}
            )
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        directory = self.root / name
        directory.mkdir(exist_ok=True)
        (directory / "adapter_model.safetensors").write_bytes(body)
        (directory / "adapter_config.json").write_bytes(config)
        statuses: list[int] = []

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        load = json.dumps({"lora_name": name, "lora_path": str(directory)}).encode()
        await self.app(_post(scope, "/v1/load_lora_adapter", load), _body(load), relay)
        if statuses and statuses[0] == 200:
            for other in self.root.iterdir():
                if other.name != name:
                    shutil.rmtree(other, ignore_errors=True)


def _is_json(text: bytes) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _post(scope: dict, path: str, body: bytes) -> dict:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    return {
        **scope,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
    }


def _body(body: bytes):
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _answer(send: Any, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
