"""The files that make a model directory serve as it is: the run's tokenizer with the chat
template it trained with, and a generation_config.json that stops where its rollouts stopped.

`AutoTokenizer.from_pretrained(d)` and `vllm serve d` read the tokenizer beside the weights. The
template saved is the one the run rendered prompts with (`[tokenizer] chat_template`: the
tokenizer's own, a .jinja file of the run, or none for plain prompts, in which case the export
claims no template the model never saw). `eos_token_id` lists every EOS id the run stopped on
(the tokenizer's and its model directory's generation config: Qwen has several), so a server
ends a completion where a rollout ended it; the base model's other generation defaults
(temperature, top_p) stay.

The GRPO job records these files once beside its checkpoints (`<checkpoints>/tokenizer`), where
`export` finds them however the config's relative paths resolve later.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from titan_learner.config.schema import Config
from titan_learner.data.tokenizer import PromptTokenizer, tokenizer_dir

TOKENIZER_RECORD = "tokenizer"
"""The directory beside a run's checkpoints that holds its serving files."""
GENERATION_CONFIG = "generation_config.json"


def generation_config(config: Config, tokenizer: PromptTokenizer) -> dict[str, Any]:
    """The base model's generation defaults (`[model] hf_checkpoint`, else the tokenizer
    directory) with the run's EOS, BOS and pad ids."""
    defaults: dict[str, Any] = {}
    bases = [Path(config.model.hf_checkpoint)] if config.model.hf_checkpoint else []
    for base in [*bases, tokenizer_dir(config)]:
        if (base / GENERATION_CONFIG).is_file():
            defaults = json.loads((base / GENERATION_CONFIG).read_text())
            break
    eos = tokenizer.eos_ids
    ids = {
        "bos_token_id": tokenizer.tokenizer.bos_token_id,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": tokenizer.pad_id,
    }
    return defaults | {key: value for key, value in ids.items() if value is not None}


def write_serving_files(config: Config, tokenizer: PromptTokenizer, directory: Path) -> None:
    """The tokenizer files (with the run's chat template) and generation_config.json."""
    hf_tokenizer = tokenizer.tokenizer
    own_template = hf_tokenizer.chat_template
    hf_tokenizer.chat_template = tokenizer.template  # what the run rendered; None: plain text
    try:
        hf_tokenizer.save_pretrained(str(directory))
    finally:
        hf_tokenizer.chat_template = own_template
    if tokenizer.template is None:  # save_pretrained keeps a template file it loaded
        (directory / "chat_template.jinja").unlink(missing_ok=True)
    text = json.dumps(generation_config(config, tokenizer), indent=2) + "\n"
    (directory / GENERATION_CONFIG).write_text(text)


def record_serving_files(
    config: Config, tokenizer: PromptTokenizer, root: str | os.PathLike
) -> Path:
    """Write the serving files to `<root>/tokenizer`, replacing a previous record whole (a run
    resumed with another template records the one it now trains with)."""
    target = Path(root) / TOKENIZER_RECORD
    staging = Path(root) / f".{TOKENIZER_RECORD}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_serving_files(config, tokenizer, staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
