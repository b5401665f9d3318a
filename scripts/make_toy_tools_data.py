"""Build the multi-turn default's files: a character tokenizer with a chat template, and
lookup questions whose answers are not in the prompt.

    python scripts/make_toy_tools_data.py [--out configs/toy_tools]

Writes (deterministically) into the output directory:
- `tokenizer/`: one token a character (digits 0-9, letters a-j) plus <pad> <bos> <sep> <eos>
  <user> <assistant> <tool> <unk>, and a chat template: a question "cf" renders as
  `<bos><user>cf<sep><assistant>`, a tool result "7" as `<tool>7<sep>`, an answer as
  `<assistant>7<eos>`.
- `train.jsonl`, `eval.jsonl`: rows {"key": "cf", "answer": "7"} for the 100 two-letter keys,
  80 to train on and 20 held out: the answer is `tools.py`'s secret table, which the model
  reaches only by calling the tool (the held-out keys cannot be memorized).
`tools.py`, `quiz.py` and `parse.py` beside them are kept by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

CHARACTERS = [str(d) for d in range(10)] + list("abcdefghij")
SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>", "<user>", "<assistant>", "<tool>", "<unk>"]
TEMPLATE = (
    "<bos>{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant>{{ m['content'] }}"
    "<eos>{% elif m['role'] == 'tool' %}<tool>{{ m['content'] }}<sep>{% else %}<user>"
    "{{ m['content'] }}<sep>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)
HELD_OUT = 20
SEED = 20261204


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(CHARACTERS + SPECIALS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        sep_token="<sep>",
        unk_token="<unk>",
        additional_special_tokens=["<user>", "<assistant>", "<tool>"],
        model_max_length=64,
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(directory))


TOOLS = Path(__file__).resolve().parents[1] / "configs" / "toy_tools" / "tools.py"


def secret_table() -> dict[str, str]:
    """The tool's table (configs/toy_tools/tools.py, kept by hand), which the answers follow."""
    spec = importlib.util.spec_from_file_location("toy_tools_tools", TOOLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TABLE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "configs" / "toy_tools"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out / "tokenizer")
    table = secret_table()
    keys = sorted(table)
    random.Random(SEED).shuffle(keys)
    for name, chosen in (("eval", keys[:HELD_OUT]), ("train", keys[HELD_OUT:])):
        rows = "".join(json.dumps({"key": k, "answer": table[k]}) + "\n" for k in chosen)
        (out / f"{name}.jsonl").write_text(rows, encoding="utf-8")
    print(f"wrote {out}: tokenizer/, {len(keys) - HELD_OUT} training and {HELD_OUT} eval keys")


if __name__ == "__main__":
    main()
