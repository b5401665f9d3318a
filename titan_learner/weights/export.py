"""Weight export: full, plain, Hugging Face-named tensors, streamed in buckets.

Every rank iterates the same buckets (each parameter is gathered with a collective), so the extra
memory per rank is about one bucket plus the parameter being gathered, never a whole-model copy.
Names go through TorchTitan's own state-dict adapter (llama3's q/k permutation for HF rotary
layout, fused QKV split back into q/k/v); the receiver checks a manifest (names, shapes, dtypes,
policy version and an xxh3 checksum of the bytes) before it swaps anything in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
import xxhash
from torch import nn
from torch.distributed.tensor import DTensor

from titan_learner.dtypes import dtype_name
from titan_learner.weights.lora import SCALING, is_adapter, merged_weight

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

Bucket = list[tuple[str, torch.Tensor]]
ToStateDict = Callable[[torch.Tensor], dict[str, torch.Tensor]]
DEFAULT_BUCKET_BYTES = 256 * 1024**2
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")
TIED_HF_PAIR = ("model.embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class WeightsManifest:
    """What a complete export contains: receivers verify it before using the weights."""

    version: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    checksum: str


class Checksum:
    """xxh3-64 over (name, bytes) in stream order: fast enough to run on every export."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        self._hash.update(name.encode())
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._hash.update(memoryview(data.cpu().numpy()))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def checksum_of(named: list[tuple[str, torch.Tensor]]) -> str:
    digest = Checksum()
    for name, tensor in named:
        digest.update(name, tensor)
    return digest.hexdigest()


def unwrapped_name(name: str) -> str:
    """A state-dict name without the wrappers AC and compile insert."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _state_dict_name(module_name: str, param_name: str) -> str:
    return unwrapped_name(f"{module_name}.{param_name}" if module_name else param_name)


def _fresh_full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter in new memory: never an alias of a live weight.

    `full_tensor()` on a one-rank mesh hands back the local shard itself, so sharing is checked.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    full = param.full_tensor() if isinstance(param, DTensor) else param
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.detach().clone()
    return full


def _parameters(
    model: nn.Module,
) -> Iterator[tuple[str, torch.Tensor, ToStateDict, nn.Module | None]]:
    """Each parameter once (tied weights once), its state-dict name, what turns a whole copy of
    it into TorchTitan state-dict tensors (a fused QKV weight is split into wq/wk/wv by
    TorchTitan's own state-dict hook, any other parameter is itself), and the LoRA layer whose
    base weight it is (None for any other); adapters are left out."""
    from torchtitan.models.common.attention import FusedQKVLinear

    seen: set[int] = set()
    for module_name, module in model.named_modules():
        fused = isinstance(module, FusedQKVLinear)
        # A fused QKV module owns its wqkv child's parameters: split them here, skip the child.
        params = module.named_parameters() if fused else module.named_parameters(recurse=False)
        for param_name, param in params:
            if id(param) in seen or is_adapter(f"{module_name}.{param_name}"):
                continue  # tied weights: exported once here, aliased by the caller
            seen.add(id(param))
            name = _state_dict_name(module_name, param_name)
            if fused:
                to_state_dict = partial(_split_fused_qkv, module, name, name[: -len(param_name)])
            else:
                to_state_dict = partial(_as_is, name)
            owner = module.get_submodule(param_name.rpartition(".")[0])
            yield name, param, to_state_dict, owner if hasattr(owner, SCALING) else None


def titan_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, ToStateDict]]:
    """Each parameter once with its state-dict name and conversion (`_parameters`); a LoRA
    layer's weight is exported merged (W + alpha/rank B A, its adapters gathered too), its
    adapters not apart."""
    for name, param, to_state_dict, lora in _parameters(model):
        if lora is not None:
            to_state_dict = partial(_with_adapters, lora, to_state_dict)
        yield name, param, to_state_dict


def lora_layers(
    model: nn.Module,
) -> Iterator[tuple[str, nn.Module, tuple[int, ...], ToStateDict]]:
    """Each LoRA layer with its base weight's name, shape and conversion (unmerged): where its
    adapters go under Hugging Face names (titan_learner.weights.peft)."""
    for name, param, to_state_dict, lora in _parameters(model):
        if lora is not None:
            yield name, lora, tuple(param.shape), to_state_dict


def _with_adapters(owner: nn.Module, to_state_dict: ToStateDict, full: torch.Tensor) -> dict:
    """The merged weight of a LoRA layer from its whole base weight (a collective: the adapters
    are gathered here, in the same order on every rank)."""
    return to_state_dict(merged_weight(owner, full, *whole_adapters(owner)))


def whole_adapters(owner: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA layer's A and B, whole (gathered where sharded: a collective)."""
    pair = (getattr(owner, part).weight for part in ("lora_a", "lora_b"))
    lora_a, lora_b = (p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in pair)
    return lora_a, lora_b


def _split_fused_qkv(module: nn.Module, name: str, prefix: str, full: torch.Tensor) -> dict:
    from torchtitan.models.common.attention import FusedQKVLinear

    split = {name: full}
    FusedQKVLinear._split_qkv_on_save(module, split, prefix, None)
    return split


def _as_is(name: str, full: torch.Tensor) -> dict:
    return {name: full}


def iter_titan_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Fresh full tensors under TorchTitan state-dict names, one parameter at a time.

    A collective on sharded models (each DTensor is all-gathered); every rank must iterate.
    """
    for _, param, to_state_dict in titan_parameters(model):
        yield from to_state_dict(_fresh_full_tensor(param)).items()


def iter_hf_tensors(model: nn.Module, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The same stream under Hugging Face names, through the model's TorchTitan adapter.

    With tied embeddings both HF names are yielded (sharing one tensor), as in the HF model's
    own state dict; sinks that store files drop the alias the way `save_pretrained` does.
    """
    adapter = spec.state_dict_adapter(spec.model, None)
    tied = spec.model.enable_weight_tying
    for name, tensor in iter_titan_tensors(model):
        for hf_name, hf_tensor in adapter.to_hf({name: tensor}).items():
            yield hf_name, hf_tensor
            if tied and hf_name in TIED_HF_PAIR:
                yield TIED_HF_PAIR[1 - TIED_HF_PAIR.index(hf_name)], hf_tensor


class WeightExport:
    """One export as an iterable of buckets; `manifest` is complete once iteration ends.

    Every rank must iterate it to the end. Ranks with `keep=False` take part in the gathers but
    receive empty buckets (the same number as everyone else, so loops stay in step).
    """

    def __init__(
        self,
        named: Iterator[tuple[str, torch.Tensor]],
        *,
        version: int,
        bucket_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
        keep: bool,
        checksum: bool = True,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self._named = named
        self.version = version
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = device
        self.keep = keep
        self.checksum = checksum
        self.manifest: WeightsManifest | None = None

    def __iter__(self) -> Iterator[Bucket]:
        names, shapes, dtypes = [], [], []
        digest = Checksum() if self.keep and self.checksum else None
        bucket: Bucket = []
        filled = 0
        for name, full in self._named:
            tensor = full.to(dtype=self.dtype) if full.is_floating_point() else full
            del full
            names.append(name)
            shapes.append(tuple(tensor.shape))
            dtypes.append(dtype_name(tensor.dtype))
            filled += tensor.numel() * tensor.element_size()
            if self.keep:
                tensor = tensor.to(self.device)
                if digest is not None:
                    digest.update(name, tensor)
                bucket.append((name, tensor))
            if filled >= self.bucket_bytes:
                yield bucket
                bucket, filled = [], 0
        if filled:
            yield bucket
        self.manifest = WeightsManifest(
            version=self.version,
            names=tuple(names),
            shapes=tuple(shapes),
            dtypes=tuple(dtypes),
            checksum=digest.hexdigest() if digest is not None else "",
        )
