"""The episode loop, token-in/token-out, driven by a scripted generator (the project's Generator
protocol, returning known ids and log-probs) and a real tokenizer trained here with a chat
template: every sampled id is the generator's, in place, with its log-prob; tool and
environment turns are context (not trained, no log-prob); each limit ends an episode as
[env] documents; a one-turn episode on the embedded HF generator is the single-turn rollout."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
import torch

from tests.support.hf_dirs import eos_ids, make_tokenizer
from titan_learner.env.environment import Answer, EnvError
from titan_learner.env.episode import EpisodeSetup, Limits, run_episodes
from titan_learner.env.render import ChatRenderer, RenderError
from titan_learner.env.tool_calls import parse_hermes
from titan_learner.env.tools import Tool, tool_schema
from titan_learner.learner.batch import ASSISTANT_MASK_KEY, LOG_PROBS_KEY, TOKENS_KEY
from titan_learner.rollout.base import rollout_from_lists

TABLE = {"apple": "red", "sky": "blue", "grass": "green"}

# Qwen3's quirks that break re-rendering a conversation: an empty thinking block on the last
# assistant turn only, and tool results rendered inside a user turn.
QWEN3_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def lookup(key: str) -> str:
    """Look a key up.

    key: the thing to look up
    """
    return TABLE[key]


def hang(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "late"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedGenerator:
    """A model that reads its context: the key from the first prompt, the turn from the
    assistant turns so far, and says `script(key, turn)`, encoded once here. What it returned
    for each context is recorded, to find every sampled id in the episodes."""

    def __init__(self, tokenizer, script, eos: int, pad: int) -> None:
        self.tokenizer, self.script, self.eos, self.pad = tokenizer, script, eos, pad
        self.weights_version = 7
        self.sampled: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}
        self.calls: list[int] = []  # rows per generate call

    def generate(self, prompts, group_size, max_new_tokens, temperature, generator):
        contexts = [prompt for prompt in prompts for _ in range(group_size)]
        completions, log_probs = [], []
        for context in contexts:
            text = self.tokenizer.decode(context, skip_special_tokens=False)
            key = re.search(r"What colour is (\w+)", text)[1]
            turn = text.count("<|im_start|>assistant") - 1
            said = self.tokenizer.encode(self.script(key, turn), add_special_tokens=False)
            ids = [*said, self.eos][:max_new_tokens]
            lps = [-(len(context) % 89) / 10 - k / 1000 for k in range(len(ids))]
            self.sampled[tuple(context)] = (ids, lps)
            completions.append(ids)
            log_probs.append(lps)
        self.calls.append(len(contexts))
        return rollout_from_lists(
            prompts, group_size, completions, log_probs, self.eos, self.pad, self.weights_version
        )

    def load_weights(self, named_tensors, version):
        raise NotImplementedError("scripted")


class Lookup:
    """A user environment: the answer is not in the prompt; reward 1 for the table's value."""

    def reset(self, row):
        return [{"role": "user", "content": f"What colour is {row['key']}? Use lookup."}]

    def step(self, messages, completion):
        key = messages[0]["content"].split()[3].rstrip("?")
        return [], float(completion.strip() == TABLE[key]), True


def setup_for(tokenizer, template, tools, env=Lookup, **limits) -> EpisodeSetup:
    schema = [tool.schema for tool in tools.values()] or None
    values = {"max_turns": 4, "max_total_tokens": 2000, "max_new_tokens": 200, "step_timeout_s": 5}
    return EpisodeSetup(
        renderer=ChatRenderer(tokenizer, template, schema),
        make_env=env,
        env_name="[env] class 'envs.py:Lookup'",
        tools=tools,
        parse=parse_hermes,
        limits=Limits(**(values | limits)),
        eos_ids=eos_ids(tokenizer),
        pad_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )


def run(tokenizer, script, keys, group_size=2, template=None, tools=None, env=Lookup, **limits):
    tools = {"lookup": Tool("lookup", lookup, tool_schema(lookup))} if tools is None else tools
    setup = setup_for(tokenizer, template or tokenizer.chat_template, tools, env=env, **limits)
    generator = ScriptedGenerator(tokenizer, script, eos_ids(tokenizer)[0], tokenizer.pad_token_id)
    rows = [({"key": key}, f"train.jsonl:{i + 1}") for i, key in enumerate(keys)]
    result = run_episodes(generator, rows, group_size, setup, 1.0, torch.Generator())
    return result, generator


def two_lookups(key: str, turn: int) -> str:
    """apple: answers at once (wrong); sky: one lookup; grass: a bad call, then two lookups."""
    plans = {
        "apple": ["no idea"],
        "sky": [call("lookup", key="sky"), "blue"],
        "grass": [
            call("lookup", ky="grass"),
            call("lookup", key="grass") + " and " + call("lookup", key="apple"),
            "green",
        ],
    }
    return plans[key][turn]


def sampled_turns(e) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled positions in the episode."""
    runs, position = [], 0
    while position < len(e.ids):
        if e.sampled[position]:
            end = position
            while end < len(e.ids) and e.sampled[end]:
                end += 1
            runs.append((position, end))
            position = end
        else:
            position += 1
    return runs


def check_token_in_token_out(result, generator) -> None:
    """Every sampled id is the generator's for that context, in place, with its log-prob;
    nothing else is trained or carries one."""
    for e in result.episodes:
        turns = sampled_turns(e)
        assert len(turns) == e.turns
        for begin, end in turns:
            ids, lps = generator.sampled[tuple(e.prompt + e.ids[:begin])]
            assert e.ids[begin:end] == ids[: end - begin]
            assert e.log_probs[begin:end] == pytest.approx(lps[: end - begin])
        assert all(math.isnan(v) for v, s in zip(e.log_probs, e.sampled, strict=True) if not s)


@pytest.mark.parametrize("template", ["chatml", "qwen3_like"])
def test_sampled_ids_are_the_generators_and_alone_trained(tokenizer, template):
    chosen = tokenizer.chat_template if template == "chatml" else QWEN3_LIKE
    result, generator = run(tokenizer, two_lookups, ["apple", "sky", "grass"], template=chosen)
    check_token_in_token_out(result, generator)
    assert [e.turns for e in result.episodes] == [1, 1, 2, 2, 3, 3]
    assert [e.tool_calls for e in result.episodes] == [0, 0, 1, 1, 3, 3]
    assert [e.tool_errors for e in result.episodes] == [0, 0, 0, 0, 1, 1]
    assert [e.env_reward for e in result.episodes] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(e.finished for e in result.episodes)
    assert generator.calls == [6, 4, 2]  # the episodes of a step advance together
    # The environment's turns are the template's deltas: the tool results are in the context.
    grass = tokenizer.decode(result.episodes[4].ids, skip_special_tokens=False)
    assert "error: lookup: missing a required argument: 'key'" in grass
    assert "green" in grass and "red" in grass
    assert result.truncated == 0
    assert [len(e.last_ids) for e in result.episodes] == [
        len(generator.sampled[tuple(e.prompt + e.ids[:b])][0])
        for e in result.episodes
        for b in [sampled_turns(e)[-1][0]]
    ]


def test_the_batch_trains_exactly_the_sampled_tokens(tokenizer):
    result, generator = run(tokenizer, two_lookups, ["apple", "grass", "sky"])
    rollout = result.rollout
    assert rollout.weights_version == 7 and rollout.prompts == [
        e.prompt for e in result.episodes[::2]
    ]
    batch = rollout.to_batch(torch.zeros(6), torch.zeros(6))
    for row, e in enumerate(result.episodes):
        tokens = batch[TOKENS_KEY][row]
        trained = batch[ASSISTANT_MASK_KEY][row]
        full = e.prompt + e.ids
        assert tokens[-len(full) :].tolist() == full
        assert trained[-len(full) :].tolist() == [False] * len(e.prompt) + e.sampled
        expected = [
            generator.sampled[tuple(full[: len(e.prompt) + b])] for b, _ in sampled_turns(e)
        ]
        assert trained.sum() == sum(len(ids) for ids, _ in expected)
        log_probs = batch[LOG_PROBS_KEY][row]
        assert log_probs[trained].tolist() == pytest.approx(
            [lp for _, lps in expected for lp in lps]
        )
        assert log_probs[~trained].isnan().all()


def test_a_delta_appends_the_template_rendering_after_the_sampled_eos(tokenizer):
    renderer = ChatRenderer(tokenizer, QWEN3_LIKE, None)
    eos = eos_ids(tokenizer)[0]
    delta = renderer.delta([{"role": "tool", "content": "red"}], eos)
    assert tokenizer.decode(delta, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\nred\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    other_eos = eos_ids(tokenizer)[1]  # not how the template closes a turn: its closing is context
    assert tokenizer.decode(renderer.delta([], other_eos), skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_the_closing_is_refused(tokenizer):
    odd = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %}<|im_end|>{% else %}<|endoftext|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(RenderError, match="closes an assistant turn differently"):
        ChatRenderer(tokenizer, odd, None).delta([{"role": "user", "content": "x"}], None)


def always_calls(key: str, turn: int) -> str:
    return call("lookup", key=key)


def test_max_turns_truncates(tokenizer):
    result, generator = run(tokenizer, always_calls, ["sky", "apple"], max_turns=3)
    check_token_in_token_out(result, generator)
    assert [e.turns for e in result.episodes] == [3] * 4
    assert not any(e.finished for e in result.episodes)
    assert result.rollout.finished.tolist() == [False] * 4
    assert result.truncated == 4
    # the last turn is the sampled one: no environment turn after the last model turn
    assert all(e.sampled[-1] for e in result.episodes)


def test_max_total_tokens_cuts_a_turn_to_what_is_left(tokenizer):
    free, _ = run(tokenizer, always_calls, ["grass"], max_turns=3)
    budget = len(free.episodes[0].prompt) + len(free.episodes[0].ids) - 5
    result, generator = run(
        tokenizer, always_calls, ["grass"], max_turns=3, max_total_tokens=budget
    )
    cut = result.episodes[0]
    assert cut.length == budget
    assert not cut.finished and cut.turns == 3
    check_token_in_token_out(result, generator)
    assert result.rollout.completion_lengths.tolist() == [budget - len(free.episodes[0].prompt)] * 2


def test_a_turn_without_eos_goes_on_closed_by_the_template(tokenizer):
    script = lambda key, turn: "blue " * 40 if turn == 0 else call("lookup", key=key)  # noqa: E731
    result, generator = run(tokenizer, script, ["sky"], template=QWEN3_LIKE, max_new_tokens=6)
    check_token_in_token_out(result, generator)
    e = result.episodes[0]
    # the cut turn was an answer (no tool call): the environment ended the episode
    assert e.turns == 1 and e.finished and e.env_reward == 0.0 and len(e.ids) == 6
    tools_first = lambda key, turn: call("lookup", key=key) if turn == 0 else "x" * 300  # noqa: E731
    result, generator = run(
        tokenizer, tools_first, ["sky"], template=QWEN3_LIKE, max_new_tokens=120
    )
    check_token_in_token_out(result, generator)
    e = result.episodes[0]
    assert e.turns == 2 and e.tool_calls == 1 and e.finished
    ids, _ = generator.sampled[tuple(e.prompt + e.ids[: sampled_turns(e)[1][0]])]
    assert tokenizer.eos_token_id not in ids  # the second turn was cut, and answered the env
    first_end = sampled_turns(e)[0][1]
    between = tokenizer.decode(e.ids[first_end : sampled_turns(e)[1][0]], skip_special_tokens=False)
    assert (
        between
        == "\n<|im_start|>user\n<tool_response>\nblue\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_cut_turn_is_closed_by_the_whole_template_closing(tokenizer):
    renderer = ChatRenderer(tokenizer, QWEN3_LIKE, None)
    closed = renderer.delta([{"role": "user", "content": "more"}], None)
    assert tokenizer.decode(closed, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_hung_tool_answers_with_an_error_and_the_episode_goes_on(tokenizer):
    tools = {"hang": Tool("hang", hang, tool_schema(hang))}
    script = lambda key, turn: call("hang", seconds=5) if turn == 0 else "blue"  # noqa: E731
    start = time.perf_counter()
    result, _ = run(tokenizer, script, ["sky"], tools=tools, step_timeout_s=0.2)
    assert time.perf_counter() - start < 4  # the two episodes' calls abandoned, not awaited
    e = result.episodes[0]
    assert e.tool_errors == 1 and e.turns == 2 and e.finished and e.env_reward == 1.0
    assert "error: hang did not return within 0.2 s" in tokenizer.decode(e.ids)


class SlowEnv(Lookup):
    def step(self, messages, completion):
        time.sleep(5)
        return [], 1.0, True


class BrokenEnv(Lookup):
    def step(self, messages, completion):
        raise KeyError("no such colour")


def run_env(tokenizer, env, **limits):
    result, _ = run(
        tokenizer, lambda key, turn: "red", ["apple", "apple", "apple"], tools={}, env=env, **limits
    )
    return result


def test_an_environment_step_that_overruns_truncates(tokenizer):
    result = run_env(tokenizer, SlowEnv, step_timeout_s=0.2)
    assert [(e.turns, e.finished, e.env_reward) for e in result.episodes] == [(1, False, None)] * 6


def test_an_environment_that_raises_is_one_line_naming_it_and_the_row(tokenizer):
    with pytest.raises(EnvError) as raised:
        run_env(tokenizer, BrokenEnv)
    assert str(raised.value) == (
        "[env] class 'envs.py:Lookup' raised on train.jsonl:1 at turn 1: KeyError: 'no such colour'"
    )


def test_the_built_in_environment_is_one_turn(tokenizer):
    env = Answer(lambda row: [{"role": "user", "content": row["q"]}])
    assert env.reset({"q": "hi"}) == [{"role": "user", "content": "hi"}]
    assert env.step([], "anything") == ([], None, True)


def test_renders_are_cached_and_handed_out_as_copies(tokenizer):
    renderer = ChatRenderer(tokenizer, QWEN3_LIKE, None)
    eos = eos_ids(tokenizer)[0]
    first = renderer.delta([{"role": "tool", "content": "red"}], eos)
    first.append(-1)  # an episode extends its own list
    again = renderer.delta([{"role": "tool", "content": "red"}], eos)
    assert again == first[:-1] and len(renderer._rendered) == 1
    assert renderer.delta([{"role": "tool", "content": "blue"}], eos) != again


def meeting(parties: int):
    """A tool that waits at a barrier of `parties` for the other calls, then echoes its key."""
    barrier = threading.Barrier(parties, timeout=2)

    def meet(key: str) -> str:
        """Wait for the other episodes' calls, then echo the key.

        key: the episode's key
        """
        barrier.wait()
        return f"met {key}"

    return meet


@pytest.mark.parametrize("workers", [3, 1])
def test_a_turns_tool_calls_run_at_once_and_answer_their_own_episodes(tokenizer, workers):
    """Three episodes' calls meet at a barrier of three: only calls running at once pass it
    (one after another, the first times out waiting for the others and breaks it); each
    answer is its own call's."""
    meet = meeting(3)
    tools = {"meet": Tool("meet", meet, tool_schema(meet))}
    script = lambda key, turn: call("meet", key=key) if turn == 0 else "done"  # noqa: E731
    keys = ["sky", "grass", "apple"]
    result, _ = run(tokenizer, script, keys, group_size=1, tools=tools, tool_workers=workers)
    for e, key in zip(result.episodes, keys, strict=True):
        told = tokenizer.decode(e.ids)
        assert e.turns == 2 and e.finished
        if workers == 3:
            assert e.tool_errors == 0 and f"met {key}" in told
            assert all(f"met {other}" not in told for other in keys if other != key)
        else:
            assert e.tool_errors == 1 and "error: meet raised BrokenBarrierError" in told
