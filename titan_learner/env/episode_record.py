"""A step's ended episodes as one tensor and back, for the rollouts a preempted run saves
ahead of its steps (`job.rollouts.OffPolicyRollouts.queued_state`): the resumed run scores,
logs and trains them as the uninterrupted run did.

Everything an ended episode is read for after sampling is kept (its ids and masks, its last
turn, the environment's rewards, its counts, its messages); its environment object is not
(it is done, and a user's object need not be serializable). JSON keeps NaN log-probs.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from titan_learner.env.episode import Episode, Episodes

KEPT = tuple(f.name for f in dataclasses.fields(Episode) if f.name != "env")


def episodes_to_tensor(episodes: Episodes) -> torch.Tensor:
    """`[bytes]` uint8: the episodes' fields but their environments, as UTF-8 JSON."""
    records = [{name: getattr(e, name) for name in KEPT} for e in episodes.episodes]
    data = json.dumps(records).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def episodes_from_tensor(saved: torch.Tensor) -> list[Episode]:
    """The episodes `episodes_to_tensor` saved (their environments None: they are done)."""
    records = json.loads(bytes(saved.tolist()).decode("utf-8"))
    return [Episode(env=None, **record) for record in records]
