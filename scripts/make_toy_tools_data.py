"""Build the multi-turn default's files: a character tokenizer with a chat template, and
questions whose answers are not in the prompt.

    python scripts/make_toy_tools_data.py [--out configs/toy_tools]

Writes (deterministically) into the output directory:
- `tokenizer/`: one token a character (digits 0-9, letters a-j) plus <pad> <bos> <sep> <eos>
  <user> <assistant> <tool> <unk>, and a chat template: a question "c" renders as
  `<bos><user>c<sep><assistant>`, a tool result "7" as `<tool>7<sep>`, an answer as
  `<assistant>7<eos>`.
- `train.jsonl`, `eval.jsonl`: rows {"key": "c", "answer": "lookup(c)"}, one a sensor a-j
  (`tools.py`'s): the question names a sensor, the answer is its current reading, which changes
  with every call to the tool, so that neither set can be answered from memory (the "answer"
  column, which the loader asks for, says where the answer comes from; the environment reads
  the tool's reply itself). The evaluation asks every sensor anew.
`tools.py`, `quiz.py` and `parse.py` beside them are kept by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHARACTERS = [str(d) for d in range(10)] + list("abcdefghij")
SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>", "<user>", "<assistant>", "<tool>", "<unk>"]
TEMPLATE = (
    "<bos>{% for m in messages %}{% if m['role'] == 'assistant' %}<assistant>{{ m['content'] }}"
    "<eos>{% elif m['role'] == 'tool' %}<tool>{{ m['content'] }}<sep>{% else %}<user>"
    "{{ m['content'] }}<sep>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)
SENSORS = "abcdefghij"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "configs" / "toy_tools"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out / "tokenizer")
    rows = "".join(json.dumps({"key": k, "answer": f"lookup({k})"}) + "\n" for k in SENSORS)
    for name in ("train", "eval"):
        (out / f"{name}.jsonl").write_text(rows, encoding="utf-8")
    print(f"wrote {out}: tokenizer/, train.jsonl and eval.jsonl ({len(SENSORS)} sensors each)")


if __name__ == "__main__":
    main()
