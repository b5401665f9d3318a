"""Trainer ranks agree before rank 0 pushes new weights to the rollout servers they share.

With rollouts sampled ahead (`[rollout] max_off_policy_steps > 0`), each rank's pipeline thread
samples on its own clock: rank 0's push of version v could land while another rank still
samples a step that needs an older version (measured before this gate: a rollout sampled under
versions 0 and 1). The pipeline's schedule is the same on every rank, and a thread asks for
version v only once it has sampled every step that needs an older one; so every rank says when
it asks (`arrive`), and the sender pushes only when all have (`wait_for_all`).

The gate speaks through the launcher's store (MASTER_ADDR:MASTER_PORT) on a connection of its
own, under a prefix unique to the run: no collective (the callers are rollout threads, while the
main threads run the learner's collectives) and nothing that holds the process group's store.
"""

from __future__ import annotations

import secrets
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from titan_learner.model.elastic_store import launcher_store
from titan_learner.vllm.server_client import ServerError

PUSH_WAIT_S = 1800.0
"""How long the sender waits for the other ranks (each may be finishing a rollout of a real
model), and the other ranks for the servers' new version."""


class PushGate:
    """`run_id`: the same on every rank and unique to the run (rank 0 draws it)."""

    def __init__(
        self, run_id: str, rank: int, world_size: int, timeout_s: float = PUSH_WAIT_S
    ) -> None:
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.timeout_s = timeout_s
        client = launcher_store(timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(f"titan_learner/push_gate/{run_id}/", client)
        self._arrivals: Counter[int] = Counter()

    def arrive(self, version: int) -> list[str]:
        """This rank is done with every version older than `version`; the keys of all ranks'
        arrivals at this push (a version may be pushed again: a preemption's drain)."""
        nth = self._arrivals[version]
        self._arrivals[version] += 1
        keys = [f"{version}/{nth}/{rank}" for rank in range(self.world_size)]
        self.store.set(keys[self.rank], "1")
        return keys

    def wait_for_all(self, keys: list[str], version: int) -> None:
        """Until every rank arrived; a rank that does not within the timeout is one error."""
        try:
            self.store.wait(keys)
        except dist.DistStoreError:
            missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            raise ServerError(
                f"trainer ranks {missing} did not finish sampling with the weights before "
                f"version {version} within {self.timeout_s:g} s; the push to the rollout "
                "servers waits for every rank"
            ) from None


def trainer_push_gate() -> PushGate | None:
    """The gate for this process group (a collective: rank 0 draws the run id); None for a
    world of one, which has nobody to wait for."""
    if dist.get_world_size() == 1:
        return None
    run_id = [secrets.token_hex(8)]
    dist.broadcast_object_list(run_id, src=0)
    return PushGate(run_id[0], dist.get_rank(), dist.get_world_size())
