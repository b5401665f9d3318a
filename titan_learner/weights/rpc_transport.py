"""Named tensors across vLLM's `collective_rpc` process boundary, as plain bytes.

vLLM 0.32's `LLM` runs its engine core in another process and msgpack-encodes every
`collective_rpc` argument. A torch tensor inside an untyped argument does not survive that: the
encoder ships its bytes out of band and the worker's untyped decoder hands back
`[dtype, shape, buffer index]` with the buffer gone. Plain `bytes` survive exactly (msgpack's bin
type), so each tensor travels as `(name, dtype name, shape, raw bytes)` and is rebuilt in the
worker. The rebuilt bytes are the sent bytes, so the manifest's xxh3 checksum still verifies
what the engine received. Costs one host copy per tensor on the sending side (into the message)
and two on the receiving side (out of it, then into a tensor that owns its memory).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan_learner.dtypes import DTYPES

PackedTensor = tuple[str, str, list[int], bytes | memoryview]
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def pack_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[PackedTensor]:
    """`(name, dtype, shape, bytes)` per tensor, from its contiguous host copy."""
    packed = []
    for name, tensor in named:
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(
                f"{name}: dtype {tensor.dtype} cannot be sent to vLLM; allowed: {', '.join(DTYPES)}"
            )
        host = tensor.detach().to("cpu").contiguous()
        raw = memoryview(host.reshape(-1).view(torch.uint8).numpy())  # msgpack copies it once
        packed.append((name, _DTYPE_NAMES[tensor.dtype], list(host.shape), raw))
    return packed


def unpack_tensors(packed: Iterable[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors `pack_tensors` sent, on the host, each owning its memory."""
    named = []
    for name, dtype_name, shape, raw in packed:
        if dtype_name not in DTYPES:
            raise TypeError(f"{name}: unknown dtype {dtype_name!r}; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype_name]
        flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        named.append((str(name), flat.view([int(d) for d in shape])))
    return named
