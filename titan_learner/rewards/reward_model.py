"""A reward model: a Hugging Face sequence-classification model (one label) as a reward.

It reads the policy's text, not its token ids: each (prompt, completion) pair is rendered as a
user and an assistant message through the reward model's own tokenizer and chat template, so a
reward model trained with another tokenizer scores what it was trained on. Pairs are scored in
batches, right-padded with the model's `pad_token_id` (transformers' sequence-classification
heads read the last non-pad token; right padding keeps every position id as in an unpadded
forward). A pair longer than `max_length` tokens loses the start of its prompt, since the
completion and the template's closing tokens are what the score is about.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelScores:
    values: list[float]
    truncated: int  # pairs that lost the start of their prompt (or more) to max_length


class RewardModel:
    """`score(prompts, completions)` with a loaded reward model, in batches, without gradients."""

    def __init__(
        self, path: Path, device: str, dtype: str, batch_size: int, max_length: int
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per rank per start says nothing
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                str(path), dtype=DTYPES[dtype]
            ).to(device)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.model.eval()
        self.device = torch.device(device)
        self.pad_id = self.model.config.pad_token_id
        self.batch_size = batch_size
        self.max_length = max_length
        self.lock = threading.Lock()  # one caller at a time: the job may score from two threads

    def render(self, prompt: str, completion: str) -> str:
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def ids(self, prompt: str, completion: str) -> tuple[list[int], bool]:
        """The pair's token ids within max_length, and whether it was cut."""
        ids = self._encode(self.render(prompt, completion))
        if len(ids) <= self.max_length:
            return ids, False
        prompt_ids = self._encode(prompt)
        cut = len(ids) - self.max_length
        while cut < len(prompt_ids):  # re-rendered: a cut can merge or split tokens at its edge
            ids = self._encode(self.render(self.tokenizer.decode(prompt_ids[cut:]), completion))
            if len(ids) <= self.max_length:
                return ids, True
            cut += len(ids) - self.max_length
        ids = self._encode(self.render("", completion))
        return ids[-self.max_length :], True  # the completion alone is too long: keep its end

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> ModelScores:
        with self.lock:
            return self._score(prompts, completions)

    @torch.inference_mode()
    def _score(self, prompts: Sequence[str], completions: Sequence[str]) -> ModelScores:
        pairs = [self.ids(p, c) for p, c in zip(prompts, completions, strict=True)]
        values: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            batch = [ids for ids, _ in pairs[start : start + self.batch_size]]
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            logits = self.model(
                input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
            ).logits
            values += logits[:, 0].float().cpu().tolist()
        return ModelScores(values, sum(cut for _, cut in pairs))


def model_device(device: str, learner_device_type: str) -> str:
    """`learner`: the device this rank's learner uses (its GPU, `local_cuda_index`, or cpu)."""
    from titan_learner.ranks import local_cuda_index

    if device != "learner":
        return device
    if learner_device_type == "cuda":
        return f"cuda:{local_cuda_index()}"
    return learner_device_type


ALLOWED = (
    "allowed: a directory saved with save_pretrained holding an "
    "AutoModelForSequenceClassification with num_labels = 1 and its tokenizer (chat template "
    "included)"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def reward_model_problem(path: Path) -> str | None:
    """What makes `path` unusable as a reward model, in words, or None; reads the config and
    the tokenizer, never the weights."""
    from transformers import AutoConfig, AutoTokenizer

    if not path.is_dir():
        return f"{path} is not a directory; {ALLOWED}"
    if not (path / "config.json").is_file():
        return f"{path} holds no config.json; {ALLOWED}"
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as err:
        return f"{path}/config.json does not load ({type(err).__name__}: {err}); {ALLOWED}"
    head = (config.architectures or ["no architecture"])[0]
    if not head.endswith("ForSequenceClassification"):
        return f"{path} holds a {head}, not a sequence-classification model; {ALLOWED}"
    if config.num_labels != 1:
        return f"{path} has num_labels = {config.num_labels}; allowed: 1 (one score per completion)"
    if config.pad_token_id is None:
        return (
            f"{path}/config.json has no pad_token_id, which batched scoring needs to find each "
            "pair's last token; allowed: a pad_token_id in its config"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); {ALLOWED}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:
        return f"{path}: its tokenizer does not load ({type(err).__name__}: {err}); {ALLOWED}"
    if not tokenizer.chat_template:
        return (
            f"{path}: its tokenizer has no chat template to render (prompt, completion) with; "
            f"{ALLOWED}"
        )
    return None
