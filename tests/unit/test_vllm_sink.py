"""The vLLM sinks (titan_learner.vllm.torchrl_sink), without an engine.

Argument checks, the engine metadata, dtype casting, manifest verification, and the flat
mapping handed to a real TorchRL sender (`VLLMDoubleBufferWeightSender`, the same
`update_weights(weights)` contract as the NCCL `VLLMWeightSender`, writing to a directory this
test reads back with TorchRL's own transport); a real TorchRL sender failing midway; TorchRL's
NCCL sender refused at once against vLLM 0.32.

vLLM's own RL API (the gloo backend): tests/unit/test_gloo_weight_transfer.py (several
workers) and tests/integration/test_vllm_engine.py (a real engine).
"""

from __future__ import annotations

import pytest
import torch
from torchrl.weight_update.llm import VLLMDoubleBufferSyncScheme, VLLMWeightSyncScheme
from torchrl.weight_update.weight_sync_schemes import WeightStrategy

from tests.support.models import batches, hf_model, learner_logits, tiny_config, tokens
from titan_learner.learner.local import LocalLearner
from titan_learner.model.hf_config import hf_config, hf_parameter_shapes
from titan_learner.vllm.torchrl_sink import (
    VLLMSink,
    check_engine_dtype,
    engine_metadata,
    engine_weights,
    torchrl_nccl_problem,
)
from titan_learner.weights.matching import WeightsError
from titan_learner.weights.sinks import push_weights

F32, BF16 = torch.float32, torch.bfloat16
BUCKET = 16 * 1024


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def trained(request):
    """A learner after one GRPO update; qwen3 ties lm_head to embed_tokens."""
    learner = LocalLearner(tiny_config(request.param))
    learner.update(batches(1)[0])
    return learner


def double_buffer(tmp_path):
    """A real TorchRL vLLM sender that runs on CPU: it writes the mapping it is handed with
    TensorDict.memmap, and the scheme's transport reads it back."""
    scheme = VLLMDoubleBufferSyncScheme(
        remote_addr=str(tmp_path / "weights"), strategy="state_dict"
    )
    sender = scheme.create_sender()
    sender.register_model(torch.nn.Module())  # creates the transport; weights are always passed
    return sender, scheme.create_transport()


# ---------------------------------------------------------------------------------------------
# Metadata, dtypes, argument checks


def test_engine_metadata_is_every_parameter_once_in_the_engine_dtype(trained):
    config = hf_config(trained.spec)
    metadata = engine_metadata(config, BF16)
    shapes, required = hf_parameter_shapes(config)
    assert list(metadata) == required
    assert all(dtype == BF16 and shape == shapes[n] for n, (dtype, shape) in metadata.items())
    exported = set(trained.get_weights().keys())
    if config.tie_word_embeddings:
        assert exported - set(metadata) == {"lm_head.weight"}, "the tied alias is not loaded"
    else:
        assert exported == set(metadata)


@pytest.mark.parametrize(
    ("dtype", "error", "message"),
    [
        ("bfloat16", TypeError, "must be a torch.dtype"),
        (torch.int8, ValueError, "not an engine dtype"),
        (torch.float64, ValueError, "allowed: torch.bfloat16, torch.float16, torch.float32"),
    ],
)
def test_engine_dtype_is_checked(dtype, error, message):
    with pytest.raises(error, match=message):
        check_engine_dtype(dtype)
    with pytest.raises(error, match=message):
        engine_metadata(hf_config(LocalLearner(tiny_config()).spec), dtype)


def test_sink_arguments_are_checked(tmp_path):
    sender, _ = double_buffer(tmp_path)
    good = {"model.norm.weight": (BF16, torch.Size([64]))}
    with pytest.raises(TypeError, match="TorchRL weight sender with update_weights"):
        VLLMSink(object(), good)
    with pytest.raises(ValueError, match="non-empty mapping"):
        VLLMSink(sender, {})
    with pytest.raises(ValueError, match=r"must be \(dtype, shape\)"):
        VLLMSink(sender, {"model.norm.weight": BF16})
    with pytest.raises(ValueError, match="not an engine dtype"):
        VLLMSink(sender, {"model.norm.weight": (torch.int64, (64,))})


def test_sink_calls_out_of_order_are_refused(tmp_path):
    sender, _ = double_buffer(tmp_path)
    sink = VLLMSink(sender, {"model.norm.weight": (BF16, torch.Size([64]))})
    with pytest.raises(WeightsError, match=r"write\(\) before begin\(\)"):
        sink.write([])
    with pytest.raises(WeightsError, match=r"commit\(\) before begin\(\)"):
        sink.commit(None)
    sink.begin(3)
    sink.abort()
    with pytest.raises(WeightsError, match=r"commit\(\) before begin\(\)"):
        sink.commit(None)
    assert sink.version is None and not (tmp_path / "weights").exists()


# ---------------------------------------------------------------------------------------------
# VLLMSink: the flat mapping handed to TorchRL


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_mapping_handed_to_torchrl_is_the_export_cast_to_the_engine_dtype(
    trained, tmp_path, dtype
):
    sender, transport = double_buffer(tmp_path)
    metadata = engine_metadata(hf_config(trained.spec), dtype)
    sink = VLLMSink(sender, metadata)
    manifest = push_weights(trained, sink, bucket_bytes=BUCKET, dtype=F32)
    assert sink.version == manifest.version == trained.policy_version == 1 and sink.consistent

    received = dict(transport.receive_weights().items())
    assert set(received) == set(metadata)
    exported = dict(trained.get_weights(dtype=F32).items())
    for name, (engine_dtype, shape) in metadata.items():
        assert received[name].dtype == engine_dtype and received[name].shape == shape, name
        assert torch.equal(received[name], exported[name].to(engine_dtype)), name

    # the mapping is complete for the engine's model: loaded into transformers, it gives the
    # learner's logits (exactly in float32; within bf16 rounding otherwise)
    model = hf_model(trained)
    result = model.load_state_dict({k: v.float() for k, v in received.items()}, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"} & set(model.state_dict())
    x = tokens()
    with torch.no_grad():
        atol = 1e-5 if dtype == F32 else 0.1
        torch.testing.assert_close(model(x).logits, learner_logits(trained, x), atol=atol, rtol=0)


def test_engine_weights_is_ordered_like_the_metadata_and_passed_through_by_torchrl(trained):
    metadata = engine_metadata(hf_config(trained.spec), BF16)
    exported = list(trained.get_weights(dtype=F32).items())
    weights = engine_weights(reversed(exported), metadata)
    assert list(weights) == list(metadata)  # the order VLLMCollectiveTransport broadcasts in
    assert all(t.dtype == BF16 and t.is_contiguous() for t in weights.values())
    # what VLLMWeightSender.update_weights does with a plain dict under strategy "state_dict"
    assert WeightStrategy(extract_as="state_dict").extract_weights(weights) is weights
    assert not hasattr(weights, "state_dict")  # so update_weights does not re-extract it


def test_a_corrupted_or_incomplete_export_sends_nothing(trained, tmp_path):
    sender, transport = double_buffer(tmp_path)
    sink = VLLMSink(sender, engine_metadata(hf_config(trained.spec), F32))
    push_weights(trained, sink, bucket_bytes=BUCKET, dtype=F32)
    served = dict(transport.receive_weights().items())

    export = trained.iter_weights(bucket_bytes=BUCKET, dtype=F32)
    buckets = list(export)
    corrupted = [list(bucket) for bucket in buckets]
    name, tensor = corrupted[0][0]
    corrupted[0][0] = (name, tensor + 1e-3)
    for bad, message in ((corrupted, "checksum mismatch"), (buckets[1:], "incomplete: missing")):
        sink.begin(export.manifest.version)
        for bucket in bad:
            sink.write(bucket)
        with pytest.raises(WeightsError, match=message):
            sink.commit(export.manifest)
        assert sink.version == export.manifest.version and sink.consistent
    after = dict(transport.receive_weights().items())
    assert all(torch.equal(after[k], served[k]) for k in served), "nothing reached TorchRL"


def test_an_export_that_does_not_fit_the_engine_is_rejected_before_sending(trained, tmp_path):
    other = "qwen3" if trained.spec.name == "llama3" else "llama3"
    sender, _ = double_buffer(tmp_path)
    sink = VLLMSink(sender, engine_metadata(hf_config(LocalLearner(tiny_config(other)).spec), F32))
    with pytest.raises(WeightsError, match="does not match the engine, nothing was sent"):
        push_weights(trained, sink, bucket_bytes=BUCKET, dtype=F32)
    assert sink.version is None and not (tmp_path / "weights").exists()

    metadata = engine_metadata(hf_config(trained.spec), F32)
    dtype, shape = metadata["model.norm.weight"]
    metadata["model.norm.weight"] = (dtype, torch.Size([shape[0] + 1]))
    named = list(trained.get_weights(dtype=F32).items())
    with pytest.raises(WeightsError, match=r"wrong shapes: model.norm.weight: got \(64,\)"):
        engine_weights(named, metadata)


def test_a_tied_alias_must_agree_with_its_parameter():
    learner = LocalLearner(tiny_config("qwen3"))
    metadata = engine_metadata(hf_config(learner.spec), F32)
    named = dict(learner.get_weights(dtype=F32).items())
    assert "lm_head.weight" in named and "lm_head.weight" not in metadata
    assert "lm_head.weight" not in engine_weights(named.items(), metadata)
    named["lm_head.weight"] = named["lm_head.weight"] + 1
    with pytest.raises(WeightsError, match=r"lm_head\.weight is tied to model\.embed_tokens"):
        engine_weights(named.items(), metadata)


def test_torchrl_nccl_weight_sync_is_refused_at_once_with_this_vllm(trained):
    """TorchRL 0.14.1's NCCL sender calls vLLM APIs that vLLM 0.32 no longer has: it would wait
    out a 300 s store timeout. Both ways to make that sink refuse at once, in one line."""
    problem = torchrl_nccl_problem()
    assert problem is not None
    metadata = engine_metadata(hf_config(trained.spec), BF16)
    with pytest.raises(WeightsError) as info:
        VLLMSink(VLLMWeightSyncScheme(strategy="state_dict").create_sender(), metadata)
    assert str(info.value) == problem and "\n" not in problem
    with pytest.raises(WeightsError) as info:
        VLLMSink.for_async_vllm(object(), hf_config(trained.spec), BF16)
    assert str(info.value) == problem


def test_a_failing_torchrl_sender_marks_the_engine_inconsistent(trained, tmp_path):
    """A real TorchRL sender whose transport fails midway (its directory cannot be created): the
    sink cannot tell how far the update got, so it reports the engine's weights as unknown."""
    (tmp_path / "file").write_text("not a directory")
    scheme = VLLMDoubleBufferSyncScheme(
        remote_addr=str(tmp_path / "file" / "weights"), strategy="state_dict"
    )
    sender = scheme.create_sender()
    sender.register_model(torch.nn.Module())
    sink = VLLMSink(sender, engine_metadata(hf_config(trained.spec), BF16))
    with pytest.raises(WeightsError, match="may hold a mix of vNone and v1"):
        push_weights(trained, sink, bucket_bytes=BUCKET, dtype=BF16)
    assert sink.version is None and not sink.consistent
