"""A user's files, made in the test: a Hugging Face model directory (tiny random Llama or Qwen3
saved with save_pretrained, a tokenizer trained here with a chat template and two EOS ids) and
prompt files, like a real GRPO run's inputs; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CORPUS = [
    "What is 2 + 3? The answer is \\boxed{5}.",
    "Compute 12 * 4. So the result is 48.",
    "Natalia sold 48 clips in April and half as many in May. #### 72",
    "system user assistant Solve the problem step by step.",
]
QUESTIONS = [
    ("What is 2 + 3?", "#### 5"),
    ("What is 7 - 4?", "#### 3"),
    ("Compute 6 * 7.", "#### 42"),
    ("What is 10 / 2?", "#### 5"),
    ("What is 9 + 9?", "#### 18"),
    ("Compute 3 * 3.", "#### 9"),
    ("What is 100 - 1?", "#### 99"),
    ("What is 8 + 4?", "#### 12"),
]
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 128}


def make_tokenizer(directory: Path, chat_template: bool = True):
    """A byte-level BPE tokenizer trained on a few sentences, saved as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>"
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def eos_ids(tokenizer) -> list[int]:
    """Two EOS ids, as Qwen's generation_config.json names them."""
    return [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


def make_model_dir(
    directory: Path, name: str = "llama3", chat_template: bool = True, shape: dict | None = None
) -> dict:
    """Tokenizer + tiny random model in `directory` (`shape`: [model.overrides] other than TINY);
    returns the [model] table that loads it."""
    from transformers import AutoModelForCausalLM

    from titan_learner.config.toml import config_from_dict
    from titan_learner.model.hf_config import hf_config
    from titan_learner.model.spec import model_spec

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory, chat_template)
    overrides = {
        "vocab_size": len(tokenizer),
        **(shape or TINY),
        **({"head_dim": 16} if name == "qwen3" and shape is None else {}),
    }
    model_table = {"name": name, "overrides": overrides, "hf_checkpoint": str(directory)}
    config = config_from_dict(
        {"model": {k: v for k, v in model_table.items() if k != "hf_checkpoint"}}
    )
    model = AutoModelForCausalLM.from_config(hf_config(model_spec(config.model, "sdpa")))
    model.save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_ids(tokenizer)})
    )
    return model_table


USER_REWARD = "def score(prompt, completion, row):\n    return min(len(completion), 20) / 20\n"


def job_config(root: Path, model: dict, data: dict, steps: int = 2, **sections) -> dict:
    """A GRPO job's tables on those files: the math reward plus `user_reward.py:score` (write
    USER_REWARD beside the config), evaluation, tiny groups; `sections` replace whole tables."""
    tables = {
        "model": model,
        "data": {"prompt_key": "question", "system_prompt": "Answer briefly.", **data},
        "reward": [
            {"function": "math"},
            {"function": "user_reward.py:score", "name": "length", "weight": 0.1},
        ],
        "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 6},
        "eval": {"samples_per_prompt": 2, "max_prompts": 4},
        "optimizer": {"lr": 1e-3},
        "run": {"steps": steps, "output_dir": str(root / "out"), "log_samples_every": 1},
        **sections,
    }
    return tables


def write_gsm8k_jsonl(path: Path, rows: list[tuple[str, str]] = QUESTIONS) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return path


def write_parquet(path: Path, rows: list[tuple[str, str]] = QUESTIONS) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"question": [q for q, _ in rows], "answer": [a for _, a in rows]}), path
    )
    return path


def make_reward_model_dir(directory: Path, num_labels: int = 1, head: str = "score") -> Path:
    """A tiny random Llama reward model (`head` "score": AutoModelForSequenceClassification,
    "lm": a causal LM) saved with save_pretrained beside its tokenizer (chat template included)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        LlamaConfig,
    )

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    auto.from_config(config).save_pretrained(str(directory))
    return directory
