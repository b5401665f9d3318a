"""Named tensors across vLLM's collective_rpc boundary as bytes (titan_learner.weights.rpc_transport),
through msgpack as vLLM 0.32's engine client encodes an RPC's arguments."""

from __future__ import annotations

import pytest
import torch

from titan_learner.weights.rpc_transport import pack_tensors, unpack_tensors

msgspec = pytest.importorskip("msgspec", reason="msgspec comes with vllm, not installed here")


def through_msgpack(obj):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))


def test_every_engine_dtype_and_shape_arrives_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(14, 8, generator=generator)),
        ("model.norm.weight", torch.randn(8, generator=generator).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(3, 5, generator=generator).to(torch.float16)),
        ("a.view", torch.randn(6, 4, generator=generator).t()),  # not contiguous
        ("empty", torch.empty(0, 3)),
        ("scalar", torch.tensor(2.5)),
    ]
    received = unpack_tensors(through_msgpack(pack_tensors(named)))
    assert [n for n, _ in received] == [n for n, _ in named]
    for (_, sent), (_, got) in zip(named, received, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))
    received[0][1].add_(1)  # each tensor owns its memory: writable, the message is not
    assert not torch.equal(received[0][1], named[0][1])


def test_a_dtype_outside_the_engine_dtypes_is_refused_on_both_sides():
    with pytest.raises(TypeError, match=r"x: dtype torch.int64 cannot be sent to vLLM; allowed: "):
        pack_tensors([("x", torch.zeros(2, dtype=torch.int64))])
    with pytest.raises(TypeError, match=r"x: unknown dtype 'int64'; allowed: bfloat16"):
        unpack_tensors([("x", "int64", [2], bytes(16))])
