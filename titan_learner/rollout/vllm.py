"""`VLLMGenerator`: the `Generator` contract on a vLLM engine (CUDA only; vllm is imported
lazily), with the worker extension that loads Hugging Face-named weights inside the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
from titan_learner.weights.matching import match_named_tensors


class VLLMWeightLoader:
    """A vLLM worker extension (`worker_extension_cls`): its methods run inside every worker and
    are called by name through `LLM.collective_rpc`, so no pickled callable crosses processes."""

    def load_hf_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        # vLLM's model.load_weights maps HF names onto its fused layers and slices for TP
        device = self.device  # type: ignore[attr-defined]  # the vLLM worker's
        self.model_runner.model.load_weights(  # type: ignore[attr-defined]
            weights=[(name, t.to(device, non_blocking=True)) for name, t in weights]
        )
        torch.cuda.synchronize(device)
        return len(weights)


class VLLMGenerator:
    """The `Generator` contract on a vLLM engine (needs vllm and CUDA; imported lazily).

    `model_path` is a local Hugging Face directory (config.json + safetensors) whose config's
    `eos_token_id` should be `eos_id`. Log-probs are vLLM's "raw_logprobs" (before temperature),
    the temperature-1 log-probs this module returns everywhere. Seeds: one per prompt, drawn from
    the `torch.Generator`, so a rollout is reproducible as far as vLLM's kernels are.

    Weights travel through `collective_rpc` as CPU tensors cast to the engine dtype: simple and
    correct, sized for small models. A large model should use vLLM's NCCL weight-transfer API
    (TorchRL's VLLMWeightSyncScheme) instead.
    """

    def __init__(
        self,
        model_path: str,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        dtype: torch.dtype = torch.bfloat16,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "VLLMGenerator needs vllm (pip install vllm) on a CUDA machine; "
                "HFGenerator is the embedded alternative"
            ) from err
        from transformers import AutoConfig

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
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            skip_tokenizer_init=True,
            worker_extension_cls=f"{__name__}.VLLMWeightLoader",
            **engine_kwargs,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check names and shapes against the HF model, then load on every worker."""
        incoming = match_named_tensors(
            named_tensors,
            self._shapes,
            required=self._required,
            rejected="load_weights rejected the weights, nothing was copied",
        )
        weights = [(n, t.detach().to("cpu", self.dtype).contiguous()) for n, t in incoming.items()]
        self.llm.collective_rpc("load_hf_weights", args=(weights,))
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version = int(version)

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

        check_generate_args(
            prompts, group_size, max_new_tokens, temperature, self.vocab_size, generator
        )
        seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device)
        base_seed = int(seed)
        params = [
            SamplingParams(
                n=group_size,
                temperature=temperature,
                max_tokens=max_new_tokens,
                stop_token_ids=list(self.eos_ids),
                logprobs=1,
                seed=base_seed + i,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions: list[list[int]] = []
        log_probs: list[list[float]] = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            if len(samples) != group_size:
                raise RuntimeError(f"vLLM returned {len(samples)} samples, asked for {group_size}")
            for sample in samples:
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
