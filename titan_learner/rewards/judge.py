"""An LLM judge as a reward: any OpenAI-compatible chat endpoint (`vllm serve`, `titan-learner
serve`, a hosted API) reads a prompt rendered from a Jinja template and replies; a regular
expression with one group takes the score out of the reply.

Requests run `concurrency` at a time in threads (they wait on the network, not the CPU). Each
request must be over within `timeout_s` (connect, send and the whole reply: a total deadline,
rewards.deadline_post) and gets at most `retries` more tries (connection errors, timeouts, 5xx),
with a short backoff, so a judge that is down or slow costs a bounded time per completion. The
proxy variables (HTTPS_PROXY, HTTP_PROXY, NO_PROXY) are honoured as urllib does
(rewards.proxy_route), read once when the judge is built; the deadline covers the proxy too. A
token (`api_key_env`: a hosted API, vLLM's `--api-key`, `titan-learner serve`) is read from the
environment, never from the config file. A reply that does not parse, or a request that still
fails, is an error of that completion, handled by the reward's `on_error`; every raw reply is
kept for samples.jsonl.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from titan_learner.rewards.deadline_post import HTTPStatusError, post_within
from titan_learner.rewards.proxy_route import proxy_for

JUDGE_KEYS = {
    "base_url": "http(s)://host:port/v1",
    "model": "the served model's name",
    "prompt": "a .jinja file (sees prompt, completion, answer, row)",
    "parse": "a regular expression with one group: the score",
    "temperature": "a number >= 0 (default 0.0)",
    "max_tokens": "an integer >= 1 (default 256)",
    "concurrency": "an integer >= 1 (default 8)",
    "retries": "an integer >= 0 (default 2)",
    "api_key_env": "the name of an environment variable holding the endpoint's bearer token",
}
REQUIRED = ("base_url", "model", "prompt", "parse")
_BACKOFF_S = 0.5

Outcome = tuple[str, object]


@dataclass(frozen=True)
class JudgeSettings:
    base_url: str
    model: str
    prompt: str
    parse: str
    temperature: float = 0.0
    max_tokens: int = 256
    concurrency: int = 8
    retries: int = 2
    api_key_env: str | None = None


class Judge:
    """`run(items, timeout_s)`: one outcome and one raw reply (or None) per (prompt,
    completion, row)."""

    def __init__(self, settings: JudgeSettings, base_dir: Path, answer_key: str) -> None:
        import jinja2

        path = Path(settings.prompt)
        text = (path if path.is_absolute() else base_dir / path).read_text()
        self.template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text)
        self.settings = settings
        self.pattern = re.compile(settings.parse, re.DOTALL)
        self.answer_key = answer_key
        self.url = settings.base_url.rstrip("/") + "/chat/completions"
        self.proxy = proxy_for(self.url)
        self.request_label = f"POST {self.url}" + (
            f" via proxy {self.proxy.address}" if self.proxy else ""
        )
        self.headers = {"Content-Type": "application/json"}
        if settings.api_key_env:
            self.headers["Authorization"] = f"Bearer {os.environ[settings.api_key_env]}"

    def run(
        self, items: Sequence[tuple[str, str, dict]], timeout_s: float
    ) -> tuple[dict[int, Outcome], list[str | None]]:
        with ThreadPoolExecutor(self.settings.concurrency, "reward-judge") as threads:
            done = list(threads.map(lambda item: self._one(item, timeout_s), items))
        return {i: outcome for i, (outcome, _) in enumerate(done)}, [r for _, r in done]

    def _one(self, item: tuple[str, str, dict], timeout_s: float) -> tuple[Outcome, str | None]:
        prompt, completion, row = item
        try:
            text = self.template.render(
                prompt=prompt, completion=completion, answer=row.get(self.answer_key), row=row
            )
        except Exception as err:
            return ("raised", f"rendering the prompt: {type(err).__name__}: {err}"), None
        reply, failure = self._ask(text, timeout_s)
        if reply is None:
            return ("failed", failure), None
        match = self.pattern.search(reply)
        if match is None:
            return ("did not parse", f"no match of {self.settings.parse!r} in {reply!r}"), reply
        try:
            return ("ok", float(match.group(1))), reply
        except ValueError:
            return ("did not parse", f"{match.group(1)!r} is not a number"), reply

    def _ask(self, text: str, timeout_s: float) -> tuple[str | None, str]:
        body = json.dumps(
            {
                "model": self.settings.model,
                "messages": [{"role": "user", "content": text}],
                "temperature": self.settings.temperature,
                "max_tokens": self.settings.max_tokens,
            }
        ).encode()
        failure = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
            try:
                answer = json.loads(
                    post_within(self.url, body, self.headers, timeout_s, self.proxy)
                )
                return answer["choices"][0]["message"]["content"] or "", ""
            except HTTPStatusError as err:
                failure = f"{self.request_label}: {err}"
                if err.code < 500:
                    break  # a request the endpoint refuses will not pass on a retry
            except (OSError, http.client.HTTPException) as err:  # TimeoutError is an OSError
                failure = f"{self.request_label}: {type(err).__name__}: {err}"
            except (ValueError, KeyError, IndexError) as err:
                failure = (
                    f"{self.request_label}: not a chat completion ({type(err).__name__}: {err})"
                )
                break
        tries = attempt + 1
        return None, f"{failure} ({tries} tr{'y' if tries == 1 else 'ies'})"


def judge_settings(table: dict) -> JudgeSettings:
    """The judge table as settings (validated already: job.checks)."""
    return JudgeSettings(**table)
