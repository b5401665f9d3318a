"""One engine's weight-update session as the trainer sees it, and how a session is abandoned.

vLLM's workers keep a session open from an accepted `start_weight_update` until a
`finish_weight_update` that returns, or any `update_weights` that raises; while one is open,
every `start_weight_update` is refused ("already active"). A session the trainer cannot finish
(another server of the group refused the manifest, a finish failed, the trainer died between
start and finish) would refuse every later update, and a restarted job with it. vLLM has no
route to end a session, so the trainer ends it the way vLLM does: an update the workers refuse
(`update_wire.abandoned_update`, which our checked engines refuse without touching their data
channel). `UpdateSession` tracks whether its engine's session is open, abandons it where a round
failed, and, where a start is refused, abandons what another trainer left open and starts once
more.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from titan_learner.vllm.update_wire import abandoned_update


class UpdateSession:
    """vLLM's control calls on one engine's client (`ServerClient`, `OfflineClient`), with
    its session's state."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.open = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        try:
            self.client.start_weight_update()
        except Exception as err:
            self._abandon()
            self.client.start_weight_update()  # still refused: that error is raised
            warnings.warn(
                f"a weight-update session was left open (a trainer stopped between start and "
                f"finish), abandoned: {err}",
                stacklevel=2,
            )
        self.open = True

    def update_weights(self, update_info: Any) -> None:
        try:
            self.client.update_weights(update_info)
        except BaseException:
            self.open = False  # a raising update ends the workers' session
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)
        self.open = False

    def abandon_weight_update(self) -> None:
        """End this engine's session if it is open; best effort (the round's own error is
        what the caller raises)."""
        if self.open:
            self._abandon()
            self.open = False

    def _abandon(self) -> None:
        # the refusal that ends the session, or an engine that is gone
        with contextlib.suppress(Exception):
            self.client.update_weights(abandoned_update())
