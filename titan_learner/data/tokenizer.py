"""The job's tokenizer: prompts rendered with the chat template, completions decoded for rewards.

The tokenizer is the Hugging Face tokenizer of `[tokenizer] path` (default: the model directory,
`[model] hf_checkpoint`). Prompts are rendered with its chat template and
`add_generation_prompt=True` (`chat_template = "auto"`), with a template file
(`chat_template = "file.jinja"`), or as plain text that the tokenizer frames with its own
special tokens (`"none"`). Generation stops on every EOS id the tokenizer and the model
directory's generation_config.json name (Qwen has several).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_learner.config.errors import ConfigError
from titan_learner.config.schema import Config
from titan_learner.data.errors import DataError
from titan_learner.data.files import resolve


@dataclass
class PromptTokenizer:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    template: str | None  # None: no chat template, the prompt text as is
    system_prompt: str | None
    prompt_key: str
    messages_key: str | None
    eos_ids: list[int]
    pad_id: int
    skip_special_tokens: bool

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def messages(self, row: dict, origin: str) -> list[dict]:
        if self.messages_key is not None:
            chat = row[self.messages_key]
            if not isinstance(chat, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in chat
            ):
                raise DataError(
                    f"{origin}: {self.messages_key!r} must be a list of "
                    '{"role": ..., "content": ...} messages'
                )
            chat = list(chat)
        else:
            chat = [{"role": "user", "content": self.prompt_text(row, origin)}]
        if self.system_prompt and not (chat and chat[0].get("role") == "system"):
            chat = [{"role": "system", "content": self.system_prompt}, *chat]
        return chat

    def prompt_text(self, row: dict, origin: str) -> str:
        """What rewards receive as `prompt`: the prompt column, or the last user message."""
        if self.messages_key is not None:
            users = [m["content"] for m in self.messages(row, origin) if m.get("role") == "user"]
            return str(users[-1]) if users else ""
        value = row[self.prompt_key]
        if not isinstance(value, str):
            raise DataError(
                f"{origin}: {self.prompt_key!r} must be a string, got {type(value).__name__}"
            )
        return value

    def encode(self, row: dict, origin: str) -> list[int]:
        """The prompt's token ids, as the model sees them."""
        if self.template is None:
            text = self.prompt_text(row, origin)
            if self.system_prompt:
                text = f"{self.system_prompt}\n{text}"
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        rendered = self.tokenizer.apply_chat_template(
            self.messages(row, origin),
            chat_template=self.template,
            add_generation_prompt=True,
            tokenize=False,
        )
        # A chat template writes the special tokens (BOS included) itself.
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def tokenizer_dir(config: Config) -> Path:
    """Where the tokenizer is: [tokenizer] path, else [model] hf_checkpoint."""
    base = Path(config.source).parent
    if config.tokenizer.path:
        return resolve(config.tokenizer.path, base)
    if config.model.hf_checkpoint:
        return Path(config.model.hf_checkpoint)
    raise ConfigError(
        "no tokenizer: [tokenizer] path is not set and there is no [model] hf_checkpoint; "
        "allowed: a directory with tokenizer.json / tokenizer_config.json",
        source=config.source,
        where="[tokenizer] path",
    )


def tokenizer_key(config: Config) -> str:
    """The config key that names the tokenizer directory, for errors."""
    return "[tokenizer] path" if config.tokenizer.path else "[model] hf_checkpoint"


def require_tokenizer_dir(config: Config) -> Path:
    """The tokenizer directory, which must exist (ConfigError naming it otherwise)."""
    directory = tokenizer_dir(config)
    if not directory.is_dir():
        raise ConfigError(
            f"tokenizer directory {directory} not found; allowed: a directory with "
            "tokenizer.json / tokenizer_config.json",
            source=config.source,
            where=tokenizer_key(config),
        )
    return directory


def load_tokenizer(config: Config) -> PromptTokenizer:
    """The job's tokenizer; ConfigError names what is missing (directory, template)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = require_tokenizer_dir(config)
    where = tokenizer_key(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"cannot load a tokenizer from {directory}: {first}", source=config.source, where=where
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    eos_ids = _eos_ids(tokenizer, directory)
    if not eos_ids:
        raise ConfigError(
            f"the tokenizer in {directory} names no EOS token; allowed: a tokenizer with an "
            "eos_token (or a generation_config.json with eos_token_id)",
            source=config.source,
            where=where,
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return PromptTokenizer(
        tokenizer=tokenizer,
        template=_template(config, tokenizer, directory),
        system_prompt=config.data.system_prompt,
        prompt_key=config.data.prompt_key,
        messages_key=config.data.messages_key,
        eos_ids=eos_ids,
        pad_id=int(pad_id),
        skip_special_tokens=config.tokenizer.skip_special_tokens,
    )


def _template(config: Config, tokenizer: Any, directory: Path) -> str | None:
    choice = config.tokenizer.chat_template
    if choice == "none":
        return None
    if choice == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"the tokenizer in {directory} has no chat template; allowed: "
                'chat_template = "none" (plain prompts) or a .jinja file',
                source=config.source,
                where="[tokenizer] chat_template",
            )
        return tokenizer.chat_template
    path = resolve(choice, Path(config.source).parent)
    if not path.is_file():
        raise ConfigError(
            f"template file {path} not found; allowed: auto, none or a .jinja file",
            source=config.source,
            where="[tokenizer] chat_template",
        )
    return path.read_text(encoding="utf-8")


def _eos_ids(tokenizer: Any, directory: Path) -> list[int]:
    """The tokenizer's EOS and every eos_token_id of generation_config.json, in that order."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    generation = directory / "generation_config.json"
    if generation.is_file():
        try:
            named = json.loads(generation.read_text()).get("eos_token_id")
        except (OSError, ValueError):
            named = None
        ids += named if isinstance(named, list) else [named] if named is not None else []
    return list(dict.fromkeys(int(i) for i in ids))
