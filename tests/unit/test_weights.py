"""Exported weights are what transformers (and so vLLM) expect, streamed and delivered intact.

Sharded exports are compared with the one-process export in test_parity.py (every layout, after
three updates); here the one-process export is checked against transformers itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM

from tests.support.models import VOCAB, batches, tiny_config
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config
from titan_learner.weights.export import checksum_of
from titan_learner.weights.matching import WeightsError
from titan_learner.weights.sinks import (
    HFModelSink,
    SafetensorsDirSink,
    push_weights,
    read_export_version,
    verify,
)

HF_CLASSES = {"llama3": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
F32 = torch.float32


def hf_model(learner) -> torch.nn.Module:
    config = hf_config(learner.spec)
    return HF_CLASSES[learner.spec.name](config).float().eval()


def titan_logits(learner, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return learner.model(tokens).float()


def tokens(batch_size: int = 3, length: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, length), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def trained(request):
    """A learner after two GRPO updates (the weights really moved)."""
    learner = LocalLearner(tiny_config(request.param))
    initial = dict(learner.get_weights(dtype=F32).items())
    for batch in batches(2):
        learner.update(batch)
    return learner, initial


def test_export_loads_strictly_into_transformers_with_equal_logits(trained):
    learner, initial = trained
    exported = dict(learner.get_weights(dtype=F32).items())
    model = hf_model(learner)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in exported.items()} == expected
    model.load_state_dict(exported, strict=True)
    x = tokens()
    with torch.no_grad():
        hf_logits = model(x).logits
    torch.testing.assert_close(hf_logits, titan_logits(learner, x), atol=1e-5, rtol=0)
    moved = [k for k in exported if not torch.equal(exported[k], initial[k])]
    assert len(moved) == len(exported), "every exported tensor follows the updates"


def test_default_export_is_bf16_plain_cpu_tensors(trained):
    learner, _ = trained
    weights = learner.get_weights()
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert tensor.device.type == "cpu" and type(tensor) is torch.Tensor, name


def test_streamed_buckets_equal_the_full_export_and_respect_the_bound(trained):
    learner, _ = trained
    full = dict(learner.get_weights(dtype=F32).items())
    largest = max(t.numel() * t.element_size() for t in full.values())
    bucket_bytes = 8 * 1024
    export = learner.iter_weights(bucket_bytes=bucket_bytes, dtype=F32)
    buckets = list(export)
    assert len(buckets) > 3
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) < bucket_bytes + largest
    streamed = [pair for bucket in buckets for pair in bucket]
    assert [name for name, _ in streamed] == list(full)
    for name, tensor in streamed:
        torch.testing.assert_close(tensor, full[name], atol=0, rtol=0)
    manifest = export.manifest
    assert manifest.version == learner.policy_version == 2
    assert manifest.names == tuple(full)
    assert manifest.checksum == checksum_of(streamed)


def test_exported_tensors_are_copies_not_live_weights(trained):
    learner, _ = trained
    weights = learner.get_weights(dtype=F32)
    name = next(iter(weights.keys()))
    weights[name].add_(1.0)
    assert not torch.equal(learner.get_weights(dtype=F32)[name], weights[name])


def test_hf_model_sink_receives_a_version_and_keeps_old_weights_on_failure(trained):
    learner, _ = trained
    receiver = hf_model(learner)
    sink = HFModelSink(receiver)
    manifest = push_weights(learner, sink, bucket_bytes=16 * 1024, dtype=F32)
    assert sink.version == manifest.version == learner.policy_version
    x = tokens()
    with torch.no_grad():
        before = receiver(x).logits.clone()
    torch.testing.assert_close(before, titan_logits(learner, x), atol=1e-5, rtol=0)

    class Flaky(HFModelSink):
        def write(self, bucket):
            if self._staged:
                raise ConnectionError("link dropped")
            super().write(bucket)

    with pytest.raises(WeightsError, match="failed midway: link dropped"):
        push_weights(learner, Flaky(receiver), bucket_bytes=16 * 1024, dtype=F32)
    with torch.no_grad():
        torch.testing.assert_close(receiver(x).logits, before, atol=0, rtol=0)


def test_a_corrupted_export_is_rejected_before_anything_changes(trained):
    learner, _ = trained
    export = learner.iter_weights(dtype=F32)
    named = [pair for bucket in export for pair in bucket]
    named[0] = (named[0][0], named[0][1] + 1e-3)
    with pytest.raises(WeightsError, match="checksum mismatch"):
        verify(named, export.manifest)
    with pytest.raises(WeightsError, match="incomplete: missing"):
        verify(named[1:], export.manifest)


def test_safetensors_directory_loads_in_transformers_and_swaps_atomically(trained, tmp_path):
    learner, _ = trained
    target = tmp_path / "policy"
    sink = SafetensorsDirSink(target, hf_config(learner.spec))
    push_weights(learner, sink, bucket_bytes=16 * 1024, dtype=F32)
    assert read_export_version(target) == learner.policy_version
    model = AutoModelForCausalLM.from_pretrained(target, dtype=F32).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, titan_logits(learner, x), atol=1e-5, rtol=0)
    first = target.resolve()

    class Broken(SafetensorsDirSink):
        def write(self, bucket):
            if self._files:
                raise OSError("disk full")
            super().write(bucket)

    learner.policy_version += 1
    with pytest.raises(WeightsError, match="disk full"):
        push_weights(learner, Broken(target, hf_config(learner.spec)), bucket_bytes=16 * 1024)
    assert target.resolve() == first and read_export_version(target) == learner.policy_version - 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", first.name]

    push_weights(learner, SafetensorsDirSink(target, hf_config(learner.spec)), 16 * 1024)
    assert read_export_version(target) == learner.policy_version
    assert not first.exists(), "the previous version's directory is removed after the swap"
    learner.policy_version -= 1


def test_a_real_directory_is_never_overwritten(tmp_path):
    (tmp_path / "policy").mkdir()
    with pytest.raises(FileExistsError, match="not a titan_learner export link"):
        SafetensorsDirSink(tmp_path / "policy", config=None)


def test_streaming_peak_memory_is_about_one_bucket():
    """benchmarks/bench_weights.py measures RSS growth while a ~80 MB model is exported."""
    sets = {"vocab_size": 8192, "dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
    args = [arg for k, v in sets.items() for arg in ("--set", f"model.overrides.{k}={v}")]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_weights.py", *args, "--bucket-mb", "4", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        check=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    largest_mib = 8192 * 512 * 4 / 1024**2  # the embedding (and lm_head): one tensor
    assert measured["streamed_peak_mib"] < 2 * (measured["bucket_mib"] + largest_mib), measured
    assert measured["whole_peak_mib"] > 0.9 * measured["model_mib"], measured
    assert measured["streamed_peak_over_model"] < 0.5, measured


def test_a_learner_starts_from_an_hf_checkpoint_directory(trained, tmp_path):
    """[model] hf_checkpoint: safetensors read back through TorchTitan's adapter (from_hf)."""
    learner, _ = trained
    target = tmp_path / "policy"
    push_weights(learner, SafetensorsDirSink(target, hf_config(learner.spec)), 16 * 1024, F32)
    name = learner.spec.name
    sections = {"model": {"name": name, "hf_checkpoint": str(target)}}
    started = LocalLearner(tiny_config(name, **sections))
    for key, value in learner.get_weights(dtype=F32).items():
        torch.testing.assert_close(started.get_weights(dtype=F32)[key], value, atol=0, rtol=0)


def test_an_unhashed_export_still_checks_names_and_shapes(trained):
    """checksum=False (in-process receivers) skips the bytes, not the structure."""
    learner, _ = trained
    export = learner.iter_weights(dtype=F32, checksum=False)
    named = [pair for bucket in export for pair in bucket]
    assert export.manifest.checksum == ""
    verify(named, export.manifest)
    with pytest.raises(WeightsError, match="incomplete: missing"):
        verify(named[1:], export.manifest)
