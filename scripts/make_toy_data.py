"""Build the embedded default's files: a 14-token digit tokenizer, sorting prompts, an eval split.

    python scripts/make_toy_data.py [--out configs/toy]

Writes (deterministically, from a fixed seed) into the output directory:
- `tokenizer/`: tokenizer.json + tokenizer_config.json, a Hugging Face fast tokenizer built in
  code with the `tokenizers` package: ids 0-9 are the digits, then <pad> 10, <bos> 11, <sep> 12,
  <eos> 13; a prompt "31415" encodes as <bos> 3 1 4 1 5 <sep>; completions decode with no
  spaces ("1345<eos>").
- `sort_train.jsonl`, `sort_eval.jsonl`: rows {"prompt": "31415", "answer": "11345"} with 4-6
  digits drawn uniformly, the eval prompts disjoint from the training ones.
The reward is `sort_reward.py` beside them (kept by hand, not generated).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DIGITS = [str(d) for d in range(10)]
SPECIALS = ["<pad>", "<bos>", "<sep>", "<eos>"]
TRAIN_ROWS = 4096
EVAL_ROWS = 256
SEED = 20261130


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(DIGITS + SPECIALS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <sep>",
        special_tokens=[("<bos>", vocab["<bos>"]), ("<sep>", vocab["<sep>"])],
    )
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        sep_token="<sep>",
        model_max_length=64,
    )
    tokenizer.save_pretrained(str(directory))


def rows(count: int, rng: random.Random, exclude: set[str]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    seen = set(exclude)
    while len(out) < count:
        prompt = "".join(rng.choice(DIGITS) for _ in range(rng.randint(4, 6)))
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": "".join(sorted(prompt))})
    return out


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parents[1] / "configs" / "toy"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out / "tokenizer")
    rng = random.Random(SEED)
    held_out = rows(EVAL_ROWS, rng, set())
    train = rows(TRAIN_ROWS, rng, {r["prompt"] for r in held_out})
    write_jsonl(out / "sort_train.jsonl", train)
    write_jsonl(out / "sort_eval.jsonl", held_out)
    print(f"wrote {out}: tokenizer/, {len(train)} training and {len(held_out)} eval prompts")


if __name__ == "__main__":
    main()
