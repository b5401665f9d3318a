"""`HFGenerator`: the embedded default, an in-process transformers model (LlamaForCausalLM or
Qwen3ForCausalLM) built from a config, sampled by a hand loop over a KV cache so that a seeded
`torch.Generator` makes a rollout reproducible (`model.generate` takes no generator).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from titan_learner.rollout.base import (
    Rollout,
    _check_config,
    _check_special_ids,
    check_generate_args,
    eos_id_set,
    left_pad,
)
from titan_learner.weights.matching import copy_into_module


class HFGenerator:
    """An in-process transformers causal LM sampled with a KV cache and a seeded torch.Generator.

    The model is built from `config` (no download) with seeded random weights that leave the
    global RNG untouched; a job replaces them with the learner's through `load_weights` before
    the first rollout. `weights_version` is 0 until then.
    """

    def __init__(
        self,
        config: Any,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        init_seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        _check_config(config)
        _check_special_ids(eos_id, pad_id, config.vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model: nn.Module = model.to(device).eval()
        self.eos_ids = eos_id_set(eos_id)
        self.eos_id = self.eos_ids[0]
        self.pad_id = pad_id
        self.vocab_size = config.vocab_size
        self.weights_version = 0
        # transformers 5.x renamed forward's `past_key_values` to `cache`; accept either
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the model in place (cast to its dtype and device).

        Every parameter must be present with its shape; a WeightsError is raised before anything
        is copied otherwise.
        """
        copy_into_module(
            self.model,
            named_tensors,
            rejected="load_weights rejected the weights, nothing was copied",
        )
        self.weights_version = int(version)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Rollout:
        """Sample `group_size` completions per prompt (see `Generator`).

        Each prompt is prefilled once and its KV cache repeated G times; then one token per row
        and step, until every row has sampled EOS or `max_new_tokens` tokens. A finished row keeps
        being fed (padding, masked out of attention) so the batch stays rectangular; its samples
        are discarded.
        """
        from transformers import DynamicCache

        check_generate_args(
            prompts, group_size, max_new_tokens, temperature, self.vocab_size, generator
        )
        device = self.device
        if generator.device.type != device.type:
            raise ValueError(
                f"the torch.Generator is on {generator.device}, the model on {device}: "
                "sampling needs a generator on the model's device"
            )
        prompt_tokens, prompt_mask = (t.to(device) for t in left_pad(prompts, self.pad_id))
        positions = (prompt_mask.cumsum(1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=prompt_tokens,
            attention_mask=prompt_mask.long(),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        cache.batch_repeat_interleave(group_size)
        logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)
        attention = prompt_mask.long().repeat_interleave(group_size, dim=0)
        next_position = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1

        n = len(prompts) * group_size
        tokens = torch.full((n, max_new_tokens), self.pad_id, dtype=torch.int64, device=device)
        log_probs = torch.full((n, max_new_tokens), torch.nan, device=device)
        lengths = torch.zeros(n, dtype=torch.int64, device=device)
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        eos = torch.tensor(self.eos_ids, device=device)
        for step in range(max_new_tokens):
            if temperature == 0:
                sampled = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            step_log_probs = torch.log_softmax(logits, dim=-1).gather(1, sampled[:, None])[:, 0]
            active = ~finished
            tokens[:, step] = torch.where(active, sampled, self.pad_id)
            log_probs[:, step] = torch.where(active, step_log_probs, torch.nan)
            lengths += active
            finished |= active & torch.isin(sampled, eos)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            attention = torch.cat([attention, (~finished).long()[:, None]], dim=1)
            out = self.model(
                input_ids=tokens[:, step : step + 1],
                attention_mask=attention,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            logits = out.logits[:, -1].float()
            next_position = next_position + 1
        width = int(lengths.max())
        return Rollout(
            prompts=[list(map(int, p)) for p in prompts],
            group_size=group_size,
            completion_tokens=tokens[:, :width].cpu(),
            completion_log_probs=log_probs[:, :width].cpu(),
            completion_lengths=lengths.cpu(),
            finished=finished.cpu(),
            pad_id=self.pad_id,
            weights_version=self.weights_version,
        )
