"""A reward model as a reward: a tiny random AutoModelForSequenceClassification saved with
save_pretrained scores what transformers' own forward gives on the same rendered texts, in
batches, truncating long pairs from the left of the prompt; every bad directory or key is one
line and exit 2 before any model is built."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.hf_dirs import make_reward_model_dir, make_tokenizer, write_gsm8k_jsonl
from tests.unit.test_job_inputs import train, write_config
from titan_learner.cli import main
from titan_learner.config.toml import config_from_dict
from titan_learner.rewards.reward_model import RewardModel
from titan_learner.rewards.runner import build_rewards, score

PROMPTS = [
    "What is 2 + 3?",
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Compute 12 * 4.",
    "What is 100 - 1? Solve the problem step by step.",
    "What is 9 + 9?",
]
COMPLETIONS = [
    "The answer is \\boxed{5}.",
    "She sold 48 / 2 = 24 in May, so 48 + 24 = 72 in all. #### 72",
    "48",
    "Step one: 100 - 1 = 99. So the result is 99.",
    "",
]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return make_reward_model_dir(tmp_path_factory.mktemp("rm") / "reward-model")


def transformers_scores(directory, prompts, completions) -> list[float]:
    """One unpadded forward per pair, exactly as a transformers user scores it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForSequenceClassification.from_pretrained(str(directory)).eval()
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            tokenize=False,
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(float(model(**ids).logits[0, 0]))
    return out


def test_scores_equal_transformers_forward_in_batches(reward_dir):
    expected = transformers_scores(reward_dir, PROMPTS, COMPLETIONS)
    for batch_size in (1, 2, 8):
        model = RewardModel(reward_dir, "cpu", "float32", batch_size, max_length=1024)
        scored = model.score(PROMPTS, COMPLETIONS)
        assert scored.truncated == 0
        assert torch.allclose(torch.tensor(scored.values), torch.tensor(expected), atol=1e-5)


def test_a_long_pair_loses_the_start_of_its_prompt_and_is_counted(reward_dir):
    model = RewardModel(reward_dir, "cpu", "float32", batch_size=4, max_length=40)
    long_prompt = " ".join(["Natalia sold 48 clips in April."] * 6) + " What is 2 + 3?"
    prompts, completions = [long_prompt, PROMPTS[0]], ["The answer is \\boxed{5}.", "5"]
    ids, cut = model.ids(long_prompt, completions[0])
    assert cut and len(ids) <= 40
    text = model.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and "What is 2 + 3?" in text
    assert text.endswith("<|im_start|>assistant\nThe answer is \\boxed{5}.<|im_end|>\n")
    scored = model.score(prompts, completions)
    assert scored.truncated == 1
    kept = text.removeprefix("<|im_start|>user\n").partition("<|im_end|>")[0]
    expected = transformers_scores(reward_dir, [kept, PROMPTS[0]], completions)
    assert torch.allclose(torch.tensor(scored.values), torch.tensor(expected), atol=1e-5)


def test_a_model_reward_in_the_weighted_sum(tmp_path, reward_dir):
    config = config_from_dict(
        {
            "reward": [
                {"model": str(reward_dir), "weight": 0.5, "batch_size": 2, "device": "cpu"},
                {"function": "math", "weight": 2.0, "workers": 0},
            ]
        },
        source=str(tmp_path / "run.toml"),
    )
    rewards = build_rewards(config)
    assert [r.name for r in rewards] == ["reward-model", "math"]
    rows = [{"answer": a} for a in ("5", "72", "48", "98", "18")]
    scores = score(rewards, PROMPTS, COMPLETIONS, rows, [f"d.jsonl:{i}" for i in range(5)])
    model_scores = torch.tensor(transformers_scores(reward_dir, PROMPTS, COMPLETIONS))
    assert torch.allclose(scores.per_reward["reward-model"], model_scores, atol=1e-5)
    assert scores.per_reward["math"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert torch.allclose(scores.total, 0.5 * model_scores + 2.0 * scores.per_reward["math"])
    assert scores.truncated == {"reward-model": 0} and set(scores.seconds) == {
        "reward-model",
        "math",
    }


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    make_reward_model_dir(root / "causal", head="lm")
    make_reward_model_dir(root / "three", num_labels=3)
    no_tokenizer = make_reward_model_dir(root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    no_template = make_reward_model_dir(root / "no_template")
    make_tokenizer(no_template, chat_template=False)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    no_pad = make_reward_model_dir(root / "no_pad")
    config = json.loads((no_pad / "config.json").read_text())
    config.pop("pad_token_id")
    (no_pad / "config.json").write_text(json.dumps(config))
    (root / "empty").mkdir()
    return root


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            '[[reward]]\nmodel = "{root}/missing"',
            "[[reward]] #2 model: {root}/missing not found; allowed: a Hugging Face reward "
            "model directory",
        ),
        (
            '[[reward]]\nmodel = "{root}/empty"',
            "[[reward]] #2 model: {root}/empty holds no config.json; allowed: a directory saved",
        ),
        (
            '[[reward]]\nmodel = "{root}/causal"',
            "[[reward]] #2 model: {root}/causal holds a LlamaForCausalLM, not a "
            "sequence-classification model; allowed: a directory saved with save_pretrained "
            "holding an AutoModelForSequenceClassification with num_labels = 1",
        ),
        (
            '[[reward]]\nmodel = "{root}/three"',
            "[[reward]] #2 model: {root}/three has num_labels = 3; allowed: 1",
        ),
        (
            '[[reward]]\nmodel = "{root}/no_tokenizer"',
            "[[reward]] #2 model: {root}/no_tokenizer holds no tokenizer (tokenizer.json, "
            "tokenizer_config.json, tokenizer.model)",
        ),
        (
            '[[reward]]\nmodel = "{root}/no_template"',
            "[[reward]] #2 model: {root}/no_template: its tokenizer has no chat template",
        ),
        (
            '[[reward]]\nmodel = "{root}/no_pad"',
            "[[reward]] #2 model: {root}/no_pad/config.json has no pad_token_id",
        ),
        (
            '[[reward]]\nmodel = "{root}/three"\nfunction = "math"',
            "[[reward]] #2: both function and model; allowed: exactly one",
        ),
        (
            "[[reward]]\nweight = 2.0",
            "[[reward]] #2: none of function, model and judge; allowed: exactly one",
        ),
        (
            '[[reward]]\nmodel = "{root}/three"\ndevice = "gpu"',
            "[[reward]] #2 device: 'gpu'; allowed: learner, cpu, cuda or cuda:N",
        ),
        (
            '[[reward]]\nmodel = "{root}/three"\nworkers = 2',
            "[[reward]] #2 workers: workers is for a function; allowed: batch_size and device",
        ),
        (
            '[[reward]]\nmodel = "{root}/three"\nnormalize = "batch"',
            "[[reward]] #2 normalize: 'batch'",
        ),
    ],
)
def test_a_bad_reward_model_is_one_line_before_any_compute(
    tmp_path, capsys, bad_dirs, reward, message
):
    tokenizer = tmp_path / "tok"
    make_tokenizer(tokenizer)
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    config = write_config(tmp_path, str(tokenizer))
    with open(config, "a") as file:
        file.write(reward.format(root=bad_dirs) + "\n")
    err = train(capsys, config)
    assert message.format(root=bad_dirs) in err


def test_check_accepts_a_reward_model_and_warns_when_it_is_elsewhere(tmp_path, capsys, reward_dir):
    tokenizer = tmp_path / "tok"
    make_tokenizer(tokenizer)
    write_gsm8k_jsonl(tmp_path / "train.jsonl")
    config = write_config(tmp_path, str(tokenizer))
    with open(config, "a") as file:
        file.write(f'[[reward]]\nmodel = "{reward_dir}"\nweight = 0.5\n')
        file.write('[[reward]]\nmodel = "not-here/rm"\nname = "other"\n')
    assert main(["check", "--config", config]) == 0
    out = capsys.readouterr().out
    assert (
        f"warning: on this machine, [[reward]] #3 model: {tmp_path / 'not-here/rm'} not found"
        in out
    )
