"""The prompts of every step, through torchdata: shuffled per epoch, dealt to ranks, resumable.

The loader yields each step's *global* prompts (`[rollout] prompts_per_step` of them); every rank
builds the same sequence and keeps its data-parallel slice, so tensor-parallel peers hold the
same prompts and each prompt of an epoch is trained once. Epoch e is a permutation of the rows
seeded by (`[run] seed`, e); epochs follow each other without a seam until `[run] steps`.

The state is one number, the global position in that endless sequence. It goes into every
checkpoint; a resumed run continues with exactly the prompts an uninterrupted run would have
seen, also when the number of data-parallel ranks changed (TorchTitan's own loader refuses
that, its state being per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchdata.nodes import BaseNode, Batcher, Mapper

from titan_learner.config.schema import Config
from titan_learner.data.errors import DataError
from titan_learner.data.files import read_files, resolve
from titan_learner.data.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what the model sees (chat template applied)
    text: str  # what rewards see as `prompt`
    row: dict  # the dataset row (rewards read the answer from it)
    origin: str  # file:line, for errors


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    skipped: int  # overlong prompts left out ([data] overlong = "skip")


def load_prompts(config: Config, tokenizer: PromptTokenizer, files: list[str]) -> PromptSet:
    """Read, check and tokenize every prompt of `files`, before any compute."""
    data = config.data
    paths = [resolve(f, Path(config.source).parent) for f in files]
    key = data.messages_key or data.prompt_key
    rows = read_files(paths, required=[key, data.answer_key])
    prompts, skipped = [], 0
    for row in rows:
        ids = tokenizer.encode(row.values, row.origin)
        if len(ids) > data.max_prompt_tokens:
            if data.overlong == "skip":
                skipped += 1
                continue
            raise DataError(
                f"{row.origin}: the prompt is {len(ids)} tokens, more than [data] "
                f"max_prompt_tokens = {data.max_prompt_tokens}; allowed: raise it, or "
                'overlong = "skip" to leave such prompts out'
            )
        prompts.append(
            Prompt(ids, tokenizer.prompt_text(row.values, row.origin), row.values, row.origin)
        )
    if not prompts:
        raise DataError(
            f"no prompts left in {', '.join(map(str, paths))}: all {skipped} are longer than "
            f"max_prompt_tokens = {data.max_prompt_tokens}"
        )
    return PromptSet(prompts, skipped)


class EpochShuffle(BaseNode[int]):
    """Row indices, epoch after epoch, each epoch a permutation seeded by (seed, epoch)."""

    def __init__(self, size: int, seed: int, start: int = 0) -> None:
        super().__init__()
        self.size, self.seed, self.start = size, seed, start
        self.position = start
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.position = int(initial_state["position"]) if initial_state else self.start

    def next(self) -> int:
        epoch, offset = divmod(self.position, self.size)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.size, generator=generator)
        self.position += 1
        return int(self._order[offset])

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position}


class PromptLoader:
    """Each step's global prompts (`next_step`); `state_dict` / `load_state_dict` for resume."""

    def __init__(self, prompts: list[Prompt], per_step: int, seed: int, position: int = 0) -> None:
        self.prompts, self.per_step, self.seed = prompts, per_step, seed
        self._build(position)

    def _build(self, position: int) -> None:
        self._indices = EpochShuffle(len(self.prompts), self.seed, start=position)
        self._batches = Batcher(
            Mapper(self._indices, self.prompts.__getitem__), batch_size=self.per_step
        )

    @property
    def position(self) -> int:
        return self._indices.position

    @property
    def epoch(self) -> float:
        return self.position / len(self.prompts)

    def next_step(self) -> list[Prompt]:
        return next(self._batches)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "rows": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["rows"]) != len(self.prompts):
            raise DataError(
                f"the checkpoint was trained on {int(state['rows'])} prompts, the data files now "
                f"hold {len(self.prompts)}; allowed: resume on the same [data] train_files"
            )
        self._build(int(state["position"]))


def rank_slice(prompts: list, rank: int, ranks: int) -> list:
    """This data-parallel rank's contiguous share of a global list (sizes differ by at most 1)."""
    per, extra = divmod(len(prompts), ranks)
    start = rank * per + min(rank, extra)
    return prompts[start : start + per + (1 if rank < extra else 0)]
