"""Rollout generators: sample G completions per prompt with behaviour log-probs, take new weights.

One interface, `Generator`, two implementations:

- `HFGenerator`: the embedded default, an in-process transformers model (LlamaForCausalLM or
  Qwen3ForCausalLM) built from a config, sampled by a hand loop over a KV cache so that a seeded
  `torch.Generator` makes a rollout reproducible (`model.generate` takes no generator).
- `VLLMGenerator`: the same contract on a vLLM engine (CUDA only; vllm is imported lazily).

Behaviour log-probs are the temperature-1 log-probs of the sampled tokens, whatever temperature
was sampled at. GRPO's importance ratio is exp(log pi_theta(a) - log_probs(a)), where the learner's
policy (titan_learner.policy) evaluates pi_theta from unscaled logits, i.e. at temperature 1. For
that ratio to be exactly 1 on data from the same weights (on-policy), so that clipping and the
KL-to-inference estimate only see staleness, the behaviour log-probs must come from the same
temperature-1 distribution. What this does not correct: at temperature != 1 the tokens were drawn
from pi^(1/T) rather than pi, a bias the loss ignores (as most GRPO implementations do). Sample at
temperature 1 for training (the measured recipe does), or scale the learner's logits by 1/T and
return scaled log-probs here: both sides must change together.

Rollout order: the G completions of prompt p are rows p*G .. p*G + G-1 ("group p"), the layout
`titan_learner.advantage.group_advantages` expects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict
from torch import nn

from titan_learner.batch import ADVANTAGE_KEY, LOG_PROBS_KEY
from titan_learner.policy import ASSISTANT_MASK_KEY, ATTENTION_MASK_KEY, TOKENS_KEY

REWARD_KEY = "reward"
GROUP_ID_KEY = "group_id"
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")


class WeightsError(ValueError):
    """Named tensors that do not match the generator's model; raised before anything is copied."""


# ---------------------------------------------------------------------------------------------
# Rollout: what a generator returns, and its conversion into the learner's batch format


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded int64 tokens `[n, L]` and the bool mask of real tokens."""
    width = max((len(s) for s in sequences), default=0)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if len(seq):
            tokens[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.int64)
            mask[row, width - len(seq) :] = True
    return tokens, mask


def _per_sequence(value: torch.Tensor, n: int, name: str) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.shape not in ((n,), (n, 1), (n, 1, 1)):
        raise ValueError(
            f"{name} must hold one value per sequence: [N], [N, 1] or [N, 1, 1] with N={n}, "
            f"got {tuple(value.shape)}"
        )
    return value.reshape(n).float()


@dataclass(frozen=True, eq=False)
class Rollout:
    """G completions for each of P prompts, with the behaviour log-probs of their tokens.

    `completion_tokens[i, :completion_lengths[i]]` is row i's completion (EOS included when it was
    sampled; `finished[i]` says so); the rest of the row is `pad_id`. `completion_log_probs` is
    the temperature-1 log-prob of each sampled token, NaN past the end. Row i answers prompt
    `prompts[i // group_size]`.
    """

    prompts: list[list[int]]
    group_size: int
    completion_tokens: torch.Tensor  # [N, M] int64
    completion_log_probs: torch.Tensor  # [N, M] float32
    completion_lengths: torch.Tensor  # [N] int64
    finished: torch.Tensor  # [N] bool
    pad_id: int
    weights_version: int

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        n = len(self.prompts) * self.group_size
        if self.completion_tokens.dim() != 2 or self.completion_tokens.shape[0] != n:
            raise ValueError(
                f"completion_tokens must be [N, M] with N = {len(self.prompts)} prompts x "
                f"{self.group_size} = {n}, got {tuple(self.completion_tokens.shape)}"
            )
        shape = self.completion_tokens.shape
        if self.completion_log_probs.shape != shape:
            raise ValueError(
                f"completion_log_probs must be {tuple(shape)} like completion_tokens, "
                f"got {tuple(self.completion_log_probs.shape)}"
            )
        if self.completion_lengths.shape != (n,) or self.finished.shape != (n,):
            raise ValueError(f"completion_lengths and finished must be [{n}]")

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * self.group_size

    @property
    def group_ids(self) -> torch.Tensor:
        """`[N]` int64: the index of the prompt each row answers."""
        return torch.arange(len(self.prompts)).repeat_interleave(self.group_size)

    @property
    def completion_ids(self) -> list[list[int]]:
        """Each row's completion as a list of ids (EOS included when sampled)."""
        rows = self.completion_tokens.tolist()
        return [row[:n] for row, n in zip(rows, self.completion_lengths.tolist(), strict=True)]

    def score(self, reward_fn: Callable[[Sequence[int], Sequence[int]], float]) -> torch.Tensor:
        """`[N]` float32 rewards: `reward_fn(prompt_ids, completion_ids)` for every row."""
        g = self.group_size
        rewards = torch.tensor(
            [float(reward_fn(self.prompts[i // g], c)) for i, c in enumerate(self.completion_ids)],
            dtype=torch.float32,
        )
        if not torch.isfinite(rewards).all():
            raise ValueError("reward_fn returned a non-finite reward")
        return rewards

    def to_batch(self, advantage: torch.Tensor, rewards: torch.Tensor) -> TensorDict:
        """The learner's batch (titan_learner.batch): prompt + completion, left-padded to `[N, T]`.

        The response mask covers the sampled tokens, EOS included; `("log_probs", "full")` holds
        the behaviour log-probs there and NaN elsewhere; `advantage` is `[N, 1, 1]`. Two extra
        per-sequence entries ride along: `"reward"` (float32) and `"group_id"` (int64).
        """
        n = self.num_sequences
        advantage = _per_sequence(advantage, n, "advantage")
        rewards = _per_sequence(rewards, n, "rewards")
        prompt_tokens, prompt_mask = left_pad(self.prompts, self.pad_id)
        prompt_tokens = prompt_tokens.repeat_interleave(self.group_size, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(self.group_size, dim=0)
        width = self.completion_tokens.shape[1]
        response = torch.arange(width) < self.completion_lengths.unsqueeze(1)
        tokens = torch.cat([prompt_tokens, self.completion_tokens.cpu()], dim=1)
        real = torch.cat([prompt_mask, response], dim=1)
        assistant = torch.cat([torch.zeros_like(prompt_mask), response], dim=1)
        log_probs = torch.cat(
            [torch.full(prompt_mask.shape, torch.nan), self.completion_log_probs.cpu().float()], 1
        )
        # [prompt | pad | completion | pad] -> [pad | prompt | completion]: a stable sort puts
        # padding (False) first and keeps the real tokens in order
        order = torch.argsort(real.to(torch.int8), dim=1, stable=True)
        length = int(real.sum(1).max()) if n else 0
        tokens, real, assistant, log_probs = (
            x.gather(1, order)[:, x.shape[1] - length :]
            for x in (tokens, real, assistant, log_probs)
        )
        return TensorDict(
            {
                TOKENS_KEY: torch.where(real, tokens, self.pad_id),
                ATTENTION_MASK_KEY: real,
                ASSISTANT_MASK_KEY: assistant,
                LOG_PROBS_KEY: torch.where(assistant, log_probs, torch.nan),
                ADVANTAGE_KEY: advantage.reshape(n, 1, 1),
                REWARD_KEY: rewards,
                GROUP_ID_KEY: self.group_ids,
            },
            batch_size=[n],
        )


# ---------------------------------------------------------------------------------------------
# The interface


@runtime_checkable
class Generator(Protocol):
    """Samples rollouts and takes new weights from the learner.

    `generate` returns `group_size` completions per prompt, each stopping at EOS or after
    `max_new_tokens`; temperature 0 is greedy. The result is a function of the weights, the
    inputs and the state of `generator` (a `torch.Generator` on the generator's device).
    `load_weights` takes Hugging Face-named tensors and the learner's policy version; it checks
    every name and shape before it changes anything.
    """

    weights_version: int

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
    ) -> Rollout: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None: ...


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    vocab_size: int,
    generator: torch.Generator,
) -> None:
    """The argument checks every generator makes, with errors that say what is allowed."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (rollouts are seeded), got {type(generator).__name__}"
        )
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {vocab_size}) (the model's vocab_size): "
                f"{list(prompt)}"
            )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")


def check_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    shapes: Mapping[str, torch.Size],
    required: Iterable[str],
) -> dict[str, torch.Tensor]:
    """Collect `named_tensors` and check them against a model: every required name present, no
    unknown or repeated name, every shape equal. Raises WeightsError naming each problem.

    The iterable is consumed whole first, so nothing is copied from a bad set.
    """
    incoming: dict[str, torch.Tensor] = {}
    repeated = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise WeightsError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if name in incoming:
            repeated.append(name)
        incoming[name] = tensor
    problems = []
    if repeated:
        problems.append(f"repeated names: {_names(repeated)}")
    unknown = [name for name in incoming if name not in shapes]
    if unknown:
        problems.append(f"unknown names (not parameters of the model): {_names(unknown)}")
    missing = [name for name in required if name not in incoming]
    if missing:
        problems.append(f"missing parameters: {_names(missing)}")
    wrong = [
        f"{name}: got {tuple(t.shape)}, the model has {tuple(shapes[name])}"
        for name, t in incoming.items()
        if name in shapes and t.shape != shapes[name]
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:5]) + _more(wrong, 5))
    not_float = [name for name, t in incoming.items() if not t.is_floating_point()]
    if not_float:
        problems.append(f"non-floating-point tensors: {_names(not_float)}")
    if problems:
        raise WeightsError(
            "load_weights rejected the weights, nothing was copied: " + " | ".join(problems)
        )
    return incoming


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + _more(names, limit)


def _more(items: list, limit: int) -> str:
    return f" (and {len(items) - limit} more)" if len(items) > limit else ""


def _check_config(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _check_special_ids(eos_id: int, pad_id: int, vocab_size: int) -> None:
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}={value} is outside [0, {vocab_size}) (the vocab_size)")


# ---------------------------------------------------------------------------------------------
# The embedded generator


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
        eos_id: int,
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
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.vocab_size = config.vocab_size
        self.weights_version = 0
        # transformers 5.x renamed forward's `past_key_values` to `cache`; accept either
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._params = dict(self.model.named_parameters())  # tied weights appear once
        # tied aliases (qwen3's lm_head.weight) may be sent too; they are the same tensors
        self._targets = {
            name: t
            for name, t in self.model.state_dict(keep_vars=True).items()
            if isinstance(t, nn.Parameter)
        }

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into the model in place (cast to its dtype and device).

        Every parameter must be present with its shape; a WeightsError is raised before anything
        is copied otherwise.
        """
        shapes = {name: t.shape for name, t in self._targets.items()}
        incoming = check_named_tensors(named_tensors, shapes, required=self._params)
        first_name: dict[int, str] = {}
        for name in incoming:  # tied aliases sent twice must agree, or one would silently win
            other = first_name.setdefault(id(self._targets[name]), name)
            if other != name and not torch.equal(incoming[other], incoming[name]):
                raise WeightsError(
                    f"load_weights rejected the weights, nothing was copied: {other} and {name} "
                    "are one tied parameter in the model but the tensors sent differ"
                )
        for name, tensor in incoming.items():
            self._targets[name].copy_(tensor)
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
            finished |= active & (sampled == self.eos_id)
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


# ---------------------------------------------------------------------------------------------
# vLLM


def hf_parameter_shapes(config: Any) -> tuple[dict[str, torch.Size], list[str]]:
    """Shapes of every HF parameter name (tied aliases included) and the names that must be sent,
    from a meta-device build of the transformers model: no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {
        name: t.shape
        for name, t in model.state_dict(keep_vars=True).items()
        if isinstance(t, nn.Parameter)
    }
    return shapes, [name for name, _ in model.named_parameters()]


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
        eos_id: int,
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
        self.eos_id = eos_id
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
        incoming = check_named_tensors(named_tensors, self._shapes, self._required)
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
                stop_token_ids=[self.eos_id],
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
            self.eos_id,
            self.pad_id,
            self.weights_version,
        )


def rollout_from_lists(
    prompts: list[list[int]],
    group_size: int,
    completions: list[list[int]],
    log_probs: list[list[float]],
    eos_id: int,
    pad_id: int,
    weights_version: int,
) -> Rollout:
    """A Rollout from ragged per-row completions and log-probs (what an engine returns)."""
    n = len(completions)
    width = max((len(c) for c in completions), default=0)
    tokens = torch.full((n, width), pad_id, dtype=torch.int64)
    values = torch.full((n, width), torch.nan)
    for row, (ids, lps) in enumerate(zip(completions, log_probs, strict=True)):
        if len(ids) != len(lps):
            raise ValueError(f"row {row}: {len(ids)} tokens but {len(lps)} log-probs")
        tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
        values[row, : len(lps)] = torch.as_tensor(lps, dtype=torch.float32)
    return Rollout(
        prompts=[list(map(int, p)) for p in prompts],
        group_size=group_size,
        completion_tokens=tokens,
        completion_log_probs=values,
        completion_lengths=torch.tensor([len(c) for c in completions], dtype=torch.int64),
        finished=torch.tensor([bool(c) and c[-1] == eos_id for c in completions]),
        pad_id=pad_id,
        weights_version=weights_version,
    )
