"""`ServerGenerator`: the `Generator` contract on running `vllm serve` servers.

Rollouts are token-in/token-out: each prompt's ids go to one server as one completions request
for its G samples (they share the prompt's prefix cache there), to the server with the fewest
of this rank's prompts in flight (`server_dispatch`), sent concurrently (vLLM batches what
arrives together); the sampled ids and their raw (temperature-1) log-probs come back, never
text.

Weights: trainer rank 0 pushes every update to all servers at once through vLLM's RL API (one
group: gloo on CPU, nccl on GPUs), between a pause (in-flight requests finish first) and a
resume; the servers then report the new version. Other trainer ranks send nothing: they wait
until every server reports the version before they sample, so no rank samples from weights
older than the ones it was handed, and no collective is needed (the call may come from a
rollout thread). With several ranks, rank 0 pushes only once every rank has asked for the
version (`PushGate`): no rank is then still sampling with the weights the push replaces.

With `weight_transfer = "nccl_m2n"` every trainer rank sends its own shards (`LocalShards`,
`m2n_trainer`): the job hands each rank's generator that rank's shards instead of the gathered
export, every rank's `load_weights` runs the reshard together, and rank 0 alone pauses,
finishes (with the version) and resumes the servers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from titan_learner.rollout.base import Rollout, _check_special_ids, eos_id_set, rollout_from_lists
from titan_learner.vllm.backends import resolve_weight_transfer
from titan_learner.vllm.generator import request_sampling
from titan_learner.vllm.push_gate import PUSH_WAIT_S, PushGate
from titan_learner.vllm.served_config import check_served
from titan_learner.vllm.server_client import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    ServerClient,
    ServerError,
    wait_until_listening,
)
from titan_learner.vllm.server_dispatch import prompts_in_flight, sample_on_servers
from titan_learner.vllm.server_group import ServerGroup
from titan_learner.weights.matching import match_named_tensors

if TYPE_CHECKING:
    from titan_learner.vllm.lora_adapters import AdapterServing
    from titan_learner.weights.local_shards import LocalShards

VERSION_POLL_S = 0.05
REJECTED = "load_weights rejected the weights, nothing was sent"


class ServerGenerator:
    """`urls`: the servers (`titan-learner serve` starts one). `config`: the transformers config
    of the model they serve (names and shapes each update is checked against). `dtype`: the
    weights' on the servers; `sequence_len`: the most tokens a prompt and its completion (or
    an episode) take, which the servers must take whole. `start_timeout_s`: how long to wait for
    servers that do not listen yet (started beside the job). `sender`: this
    trainer process pushes the weights (rank 0); the others wait for the servers' version.
    `gate`: with several trainer ranks, how rank 0 knows they all asked for a version.
    `shards`: for nccl_m2n, this rank's share of the learner, checked against `config` before
    any server is asked anything; `local_shards` is then set, and `load_weights` takes it
    (every rank sends; each server's send iterates it afresh). `lora` (a LoRA run's `push =
    "adapter"`): the servers serve the base they loaded, and each push is the adapters alone,
    uploaded to every server by rank 0 (vllm.adapter_route) and named in every request."""

    def __init__(
        self,
        urls: Sequence[str],
        config: Any,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        dtype: torch.dtype,
        sequence_len: int,
        sender: bool,
        weight_transfer: str = "auto",
        token: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        gate: PushGate | None = None,
        shards: LocalShards | None = None,
        lora: AdapterServing | None = None,
    ) -> None:
        from titan_learner.model.hf_config import hf_parameter_shapes

        _check_special_ids(eos_id, pad_id, config.vocab_size)
        self.eos_ids = eos_id_set(eos_id)
        self.pad_id = pad_id
        self.vocab_size = config.vocab_size
        self.dtype = dtype
        self.sequence_len = sequence_len
        self.gate = gate
        self._shapes, self._required = hf_parameter_shapes(config)
        if shards is not None:
            check_shards(shards, self._shapes, self._required)
        self.servers = [ServerClient(url, token=token, timeout_s=timeout_s) for url in urls]
        wait_until_listening(self.servers, start_timeout_s, say=print if sender else None)
        self.group = ServerGroup(self.servers)
        self.group.check_engines_answer()  # before a call that would wait behind one
        self.weight_transfer = resolve_weight_transfer(
            weight_transfer, engine_on_gpu=torch.cuda.is_available(), colocated=False
        )
        self.sender = sender
        self._transfer: Any = None
        self._adapters = lora
        self.local_shards = shards if self.weight_transfer == "nccl_m2n" else None
        if lora is not None:
            if sender:
                self._served()
        elif self.weight_transfer == "nccl_m2n":  # every rank sends
            parallel = [c["parallel_config"]["tensor_parallel_size"] for c in self._served()]
            self._transfer = _m2n_transfer(self.servers, self.group.workers, shards, parallel)
        elif sender:
            from titan_learner.vllm.transfer import EngineWeightTransfer, address_toward

            self._served()
            self._transfer = EngineWeightTransfer(
                self.group,
                self.weight_transfer,
                self.group.total_workers,
                address=address_toward(urls[0]),  # servers on other nodes connect back here
            )
        self.weights_version = 0

    def _served(self) -> list[dict[str, Any]]:
        """Each server's vLLM config, once it is known to run what this job needs
        (`served_config`; asked by the ranks that send, rank 0 at least)."""
        served = [server.served_config() for server in self.servers]
        for server, config in zip(self.servers, served, strict=True):
            check_served(
                server.url,
                config,
                transfer=self.weight_transfer,
                dtype=self.dtype,
                sequence_len=self.sequence_len,
            )
        return served

    @property
    def takes_adapters(self) -> bool:
        """Whether pushes are a LoRA run's adapters alone (`lora`), not the full weights."""
        return self._adapters is not None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.local_shards is not None and named_tensors is not self.local_shards:
            raise ValueError(
                "weight_transfer 'nccl_m2n' sends this rank's own shards: pass the "
                "generator's `local_shards`, not other tensors"
            )
        if self._adapters is not None:
            self._load_adapters(named_tensors, version)
            return
        arrivals = None if self.gate is None else self.gate.arrive(version)
        if self.local_shards is not None:
            self._send_shards(version, arrivals)
            return
        if self._transfer is None:
            self._wait_for_version(version)
            self.weights_version = int(version)
            return
        incoming = match_named_tensors(
            named_tensors,
            self._shapes,
            required=self._required,
            rejected=REJECTED,
        )
        if arrivals is not None:
            self.gate.wait_for_all(arrivals, version)
        self.group.pause()
        try:
            self._transfer.send(
                [(n, t.detach().to(self.dtype)) for n, t in incoming.items()], version
            )
            self.group.reset_prefix_cache()  # cached KV was computed with the old weights
        finally:
            self.group.resume()
        self.weights_version = int(version)

    def _load_adapters(self, named_tensors: Iterable, version: int) -> None:
        """Rank 0 uploads the adapters to every server, paused, as `adapter_name(version)`
        (replacing one of that name: a version pushed again), unloads the others and sets the
        version; the other ranks wait for the version, as for full weights."""
        from safetensors.torch import save

        from titan_learner.weights.peft import peft_config

        arrivals = None if self.gate is None else self.gate.arrive(version)
        if not self.sender:
            self._wait_for_version(version)
            self.weights_version = int(version)
            return
        lora = self._adapters
        incoming = match_named_tensors(
            named_tensors, lora.shapes, required=list(lora.shapes), rejected=REJECTED
        )
        tensors = {n: t.detach().to(self.dtype).cpu().contiguous() for n, t in incoming.items()}
        files = save(tensors, metadata={"format": "pt"})
        settings = peft_config(lora.rank, lora.alpha, list(tensors), lora.base)
        if arrivals is not None:
            self.gate.wait_for_all(arrivals, version)
        name = adapter_name(version)
        self.group.pause()
        try:
            for server in self.servers:
                if name in server.adapters():
                    server.unload_adapter(name)
                server.upload_adapter(name, files, settings)
                for other in server.adapters():
                    if other != name:
                        server.unload_adapter(other)
                server.set_weight_version(str(version))
            self.group.reset_prefix_cache()
        finally:
            self.group.resume()
        self.weights_version = int(version)

    def _send_shards(self, version: int, arrivals: Any) -> None:
        """nccl_m2n: every rank reshards its own `local_shards` into the servers (a collective,
        one tensor at a time); rank 0 pauses them first and resumes them after the version is
        set."""
        if self.sender:
            if arrivals is not None:
                self.gate.wait_for_all(arrivals, version)
            self.group.pause()
        try:
            self._transfer.send(version)
            if self.sender:
                self.group.reset_prefix_cache()  # cached KV was computed with the old weights
        finally:
            if self.sender:
                self.group.resume()
        if not self.sender:
            self._wait_for_version(version)
        self.weights_version = int(version)

    def _wait_for_version(self, version: int) -> None:
        deadline = time.monotonic() + PUSH_WAIT_S  # rank 0 may wait for a slower rank first
        for server in self.servers:
            while server.weight_version() != str(version):
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"rollout server {server.url} still serves version "
                        f"{server.weight_version()} after {PUSH_WAIT_S:g} s, expected "
                        f"{version} (pushed by trainer rank 0)"
                    )
                time.sleep(VERSION_POLL_S)

    def close(self) -> None:
        if self._transfer is not None:
            self._transfer.close()
            if self.sender:
                self.group.shutdown_weight_transfer_engine()

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Rollout:
        sampling = request_sampling(
            prompts,
            group_size,
            max_new_tokens,
            temperature,
            self.eos_ids,
            self.vocab_size,
            generator,
        )

        adapter = adapter_name(self.weights_version) if self._adapters is not None else None

        def sample(i: int, on: int) -> list[tuple[list[int], list[float], set[str]]]:
            server = self.servers[on]
            samples = server.generate([int(t) for t in prompts[i]], sampling[i], adapter)
            if len(samples) != group_size:
                raise ServerError(
                    f"rollout server {server.url} returned {len(samples)} samples, asked for "
                    f"{group_size}"
                )
            return samples

        first = sampling[0]["seed"]  # each rank starts its prompts on its own server
        per_prompt = sample_on_servers(
            len(prompts), len(self.servers), first, sample, prompts_in_flight(group_size)
        )
        samples = [s for prompt_samples in per_prompt for s in prompt_samples]
        return rollout_from_lists(
            prompts,
            group_size,
            [ids for ids, _, _ in samples],
            [log_probs for _, log_probs, _ in samples],
            self.eos_ids,
            self.pad_id,
            sampled_version(samples, self.weights_version),
        )


def adapter_name(version: int) -> str:
    """The name a LoRA run's adapters of `version` have on its servers (every rank knows it)."""
    return f"policy-v{version}"


def check_shards(shards: LocalShards, shapes: dict[str, torch.Size], required: list[str]) -> None:
    """`shards`' Hugging Face names and whole shapes against the served model's (`shapes`,
    `required`: `hf_parameter_shapes`), the check every other backend runs on each update.

    vLLM's m2n checks neither: a name its workers cannot place, or a shape that does not fit
    the parameter, is received whole for the model's `load_weights`, which fails inside the
    update while every trainer rank waits in the reshards. The plans are fixed for the run, so
    once is enough; no tensor is made (meta tensors of the whole shapes)."""
    match_named_tensors(
        (
            (plan.name, torch.empty(plan.shape, dtype=shards.dtype, device="meta"))
            for plan in shards.plans
        ),
        shapes,
        required=required,
        rejected=REJECTED,
    )


def _m2n_transfer(
    servers: list[ServerClient],
    workers: list[int],
    shards: LocalShards | None,
    tensor_parallel: list[int],
) -> Any:
    from titan_learner.ranks import rank, world_size
    from titan_learner.vllm.m2n_source import ShardSource
    from titan_learner.vllm.m2n_trainer import M2NTransfer

    if shards is None:
        raise ValueError("weight_transfer 'nccl_m2n' sends each rank's shards: pass `shards`")
    return M2NTransfer(
        servers,
        workers,
        ShardSource(shards),
        rank=rank(),
        trainer_ranks=world_size(),
        tensor_parallel=tensor_parallel,
    )


def sampled_version(samples: list[tuple[list[int], list[float], set[str]]], pushed: int) -> int:
    """The one weight version every sampled token came from, as the servers labelled them; a
    rollout that spans versions, or another version than the last pushed, is refused (its
    behaviour log-probs would not be the ones the job believes)."""
    versions = set().union(*(v for _, _, v in samples))
    if versions != {str(pushed)}:
        raise ServerError(
            f"the rollout was sampled under weight versions {sorted(versions)}, expected only "
            f"{pushed} (the version pushed last)"
        )
    return pushed
