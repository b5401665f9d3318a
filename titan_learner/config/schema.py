"""The TOML schema of a run: one plain dataclass per section, what a user writes.

The sections map onto TorchTitan's own config dataclasses in `titan_learner.model.parallelize`
and `titan_learner.learner.optim.optimizer` (ParallelismConfig, TrainingConfig, CompileConfig, AC,
optimizer, LR scheduler), so nothing TorchTitan already describes is re-implemented here.
Reading and writing TOML is `titan_learner.config.toml`; every check is in `.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

POSITIVE = {"min": 1}
NON_NEGATIVE = {"min": 0}

Dtype = Literal["float32", "bfloat16"]


@dataclass
class ModelOverrides:
    """Shape overrides applied on top of the flavor (tiny test models, vocabulary changes)."""

    vocab_size: int | None = field(default=None, metadata=POSITIVE)
    """Vocabulary size (embedding and output rows)."""
    dim: int | None = field(default=None, metadata=POSITIVE)
    """Hidden size."""
    n_layers: int | None = field(default=None, metadata=POSITIVE)
    """Number of transformer blocks."""
    n_heads: int | None = field(default=None, metadata=POSITIVE)
    """Attention (query) heads."""
    n_kv_heads: int | None = field(default=None, metadata=POSITIVE)
    """Key/value heads (grouped-query attention); default: n_heads."""
    head_dim: int | None = field(default=None, metadata=POSITIVE)
    """Per-head width (qwen3); default: dim / n_heads."""
    hidden_dim: int | None = field(default=None, metadata=POSITIVE)
    """Feed-forward (SwiGLU) width."""
    max_seq_len: int | None = field(default=None, metadata=POSITIVE)
    """Positions the RoPE tables cover: the longest prompt + completion must fit."""
    rope_theta: float | None = field(default=None, metadata={"min": 1.0})
    """RoPE base frequency."""


@dataclass
class LoRASection:
    """[model.lora]: train low-rank adapters on a frozen base (TorchTitan's LoRAConverter).

    Target Linear layers become W x + alpha/rank x B A x with W frozen, A seeded (Kaiming) and
    B zero, so training starts at the base model. Only A and B are in the optimizer and in the
    checkpoints; the KL reference is the base itself (the adapters switched off)."""

    rank: int = field(default=16, metadata=POSITIVE)
    """The adapters' rank r (A is r x in, B is out x r)."""
    alpha: float = field(default=32.0, metadata={"min": 0.0, "not": (0.0,), "allowed": "> 0"})
    """The adapters' scale is alpha / rank."""
    target_modules: list[str] | None = None
    """The Linear layers to adapt, by TorchTitan's names (the last part of the module's name):
    wqkv (q, k and v, fused in one Linear in TorchTitan 0.3.0), wo, w1, w2, w3, lm_head. Unset:
    every Linear but the output head (lm_head)."""
    push: Literal["merged", "adapter"] = "merged"
    """What rollout engines receive each step: merged, the full weights with the adapters folded
    in (W + alpha/rank x B A), which every generator loads; adapter, the adapters alone (PEFT
    files, tens of MB for 8B at rank 16), served by vLLM (each rank's engine, or the rollout
    servers through their token-guarded upload route) as a LoRA adapter over the base it loads
    itself from [model] hf_checkpoint."""


@dataclass
class ModelSection:
    name: Literal["llama3", "qwen3"] = "llama3"
    """The TorchTitan model family: its registry, sharding plan and state-dict adapter."""
    flavor: str = "debugmodel"
    """A TorchTitan flavor of the family (e.g. "8B"). With hf_checkpoint it may be left out
    (the directory's config.json gives the architecture); where given it must agree with it."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """auto: flex attention on CUDA (SDPA with [learner] share_prompts), SDPA (causal) on CPU
    where flex has no backward."""
    hf_checkpoint: str | None = None
    """A Hugging Face safetensors directory to load weights from, converted by TorchTitan's adapter."""
    init: Literal["torchtitan", "transformers"] = "torchtitan"
    """Random initial weights without hf_checkpoint: TorchTitan's init, or the matching
    transformers model's (std 0.02 everywhere), which small models trained from scratch prefer."""
    overrides: ModelOverrides = field(default_factory=ModelOverrides)
    lora: LoRASection | None = None
    """[model.lora]: train LoRA adapters on the frozen model instead of every weight."""


@dataclass
class ParallelismSection:
    dp_replicate: int = field(default=1, metadata=POSITIVE)
    """HSDP: data-parallel replicas, each holding a dp_shard-sharded copy."""
    dp_shard: int = field(
        default=-1, metadata={"min": -1, "not": (0,), "allowed": "-1 (fill the world) or >= 1"}
    )
    """-1 fills the world: world_size / (dp_replicate * tp)."""
    tp: int = field(default=1, metadata=POSITIVE)
    """Tensor-parallel degree (TorchTitan's plan for the family); the ranks of a TP group
    train on one batch."""
    sequence_parallel: bool = True
    """With tp > 1: also shard norms and activations along the sequence (TorchTitan's SP)."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2's reshard_after_forward as TorchTitan sets it: default (free gathered
    parameters after forward, except the last block's), always, or never (faster, more memory)."""
    param_dtype: Dtype = "float32"
    """FSDP mixed precision: the dtype parameters are gathered in for forward and
    backward; the sharded masters and the optimizer stay float32."""
    reduce_dtype: Literal["float32"] = "float32"
    """The dtype of the gradient reduction across data-parallel ranks."""


@dataclass
class ActivationCheckpointSection:
    mode: Literal["none", "full", "selective"] = "none"
    """TorchTitan's activation checkpointing: none, full (each block recomputed in
    backward) or selective (its per-op policy)."""


@dataclass
class CompileSection:
    enable: bool = False
    """torch.compile each transformer block (TorchTitan's per-block compile)."""
    backend: str = "inductor"
    """The torch.compile backend."""


@dataclass
class OptimizerSection:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """torch's AdamW or Adam, in TorchTitan's optimizer container."""
    lr: float = field(default=1e-5, metadata={"min": 0.0})
    """Peak learning rate (after warmup)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (beta1, beta2)."""
    eps: float = field(default=1e-8, metadata={"min": 0.0})
    """Adam's epsilon."""
    weight_decay: float = field(default=0.0, metadata={"min": 0.0})
    """Weight decay (decoupled in AdamW; added to the gradient in Adam)."""
    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """auto: fused on CUDA, foreach on CPU (fused runs there too, 3x faster at 21 M parameters,
    but parts the embedded default's trajectory from the one its numbers were measured with:
    docs/performance.md)."""


@dataclass
class LRSchedulerSection:
    warmup_steps: int = field(default=0, metadata=NON_NEGATIVE)
    """Linear warmup to lr over this many steps (TorchTitan's scheduler)."""
    decay: Literal["none", "linear", "sqrt", "cosine"] = "none"
    """After warmup: constant (none), or a decay to min_lr_factor x lr by [run] steps."""
    min_lr_factor: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    """The learning rate at the end of the decay, as a fraction of lr."""


@dataclass
class LearnerSection:
    grad_accum_steps: int = field(default=1, metadata=POSITIVE)
    """Micro-batches per optimizer step: the gradient reduction across ranks runs once, on
    the last, and the step's loss is the mean over all its tokens whatever the split."""
    clip_norm: float = field(default=1.0, metadata={"min": 0.0})
    """Global gradient-norm clipping threshold; 0 disables clipping (the norm is still reported)."""
    mixed_precision: bool = False
    """Autocast the forward pass to autocast_dtype (on top of FSDP's param_dtype)."""
    autocast_dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """The dtype of mixed_precision's autocast."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: the rank's CUDA device where there is one (NCCL), else the CPU (gloo)."""
    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """dtype of exported weights (get_weights, iter_weights, sinks): rollout engines run bf16."""
    logprob_chunk_size: int = field(default=1024, metadata=NON_NEGATIVE)
    """Token positions per lm_head chunk when the loss scores tokens (0: dense [B, T, V] logits).
    > 0 runs the lm_head only on the positions the loss scores and never holds more than one
    chunk of [chunk, vocab] float32 logits, in forward or backward. The default: as fast as the
    dense path on the smallest models, faster and far smaller on real vocabularies
    (docs/performance.md)."""
    max_tokens_per_microbatch: int = field(default=0, metadata=NON_NEGATIVE)
    """Token-budget micro-batches (0: off): each update splits the rank's batch, sorted by
    length, into micro-batches of at most this many computed positions (rows x longest row),
    each trimmed to its longest row; one optimizer step, the same loss. Needs grad_accum_steps
    = 1 and at least the longest prompt + completion."""
    share_prompts: bool = False
    """Run each prompt through the decoder once for all the rows that share it (a GRPO group's G
    completions), and no padding at all: the token-wise work shrinks to the tokens the loss
    needs, the result is the same (titan_learner.learner.forward.shared_prompts). Needs the chunked
    log-probs (logprob_chunk_size >= 1) and SDPA attention ([model] attention = "sdpa", or
    "auto", which then picks it on CUDA too)."""


@dataclass
class LossSection:
    name: Literal["grpo", "dapo", "cispo", "gspo"] = "grpo"
    """The objective: grpo, dapo, cispo (TorchRL's classes; cispo as MiniMax-M1 defines it) or
    gspo (sequence-level ratio); the other [loss] keys are its keyword arguments and ours."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the TorchRL loss class, written as plain keys of [loss] in TOML
    (`[loss.correction]` a sub-table: titan_learner.config.loss_values.CorrectionTable)."""


@dataclass
class AdvantageSection:
    """How each row's advantage is made from the rewards of its group of G completions: the
    reward less the group's mean, divided by a std + eps (TRL's `scale_rewards`)."""

    scale: Literal["group", "batch", "none"] = "group"
    """group: the group's std (GRPO); batch: the std of the step's rewards over every
    data-parallel rank; none: no division (Dr. GRPO; verl norm_adv_by_std_in_grpo = false)."""
    eps: float = field(default=1e-4, metadata={"min": 0.0, "not": (0.0,), "allowed": "> 0"})
    """Added to the std: a group (or batch) of equal rewards gets advantage 0."""


@dataclass
class KLSection:
    """The KL to the reference policy (the initial weights): in the loss or in the reward.

    placement = "loss": the KL term in the loss, coeff x mean over trained tokens of the
    estimator (k3 by default, TorchRL's own term; k1 or k2 as verl's kl_loss_type); its
    coefficient is [loss] kl_to_ref_coeff (TorchRL's key, unchanged), so [kl] coeff stays 0.
    placement = "reward" (verl's
    `use_kl_in_reward`): each completion's reward is reduced by coeff x the sum of its token
    KLs before the group advantage (titan_learner.job.kl_reward), with [loss] kl_to_ref_coeff
    unset (one KL, not two)."""

    placement: Literal["loss", "reward"] = "loss"
    """loss: TorchRL's KL term in the loss, its coefficient [loss] kl_to_ref_coeff; reward:
    each completion's reward less [kl] coeff x its summed token KLs, before the group advantage
    (verl's use_kl_in_reward)."""
    coeff: float = field(default=0.0, metadata={"min": 0.0})
    """placement = "reward" only: the KL coefficient (verl's `kl_ctrl.kl_coef`); > 0."""
    estimator: Literal["k1", "k2", "k3"] | None = None
    """The per-token estimate of KL(pi || pi_ref) from r = log pi - log pi_ref (verl's
    `kl_penalty`): k1 = r ("kl"), k2 = r^2 / 2 ("mse"), k3 = exp(-r) - 1 + r ("low_var_kl",
    clamped to [-10, 10] as verl does in the reward; the loss's k3 is TorchRL's, unclamped).
    Default: k3 in the loss (TorchRL's), k1 in the reward (verl's default)."""


@dataclass
class RolloutSection:
    generator: Literal["hf", "vllm"] = "hf"
    """hf: an in-process transformers model per rank (the embedded default); vllm: engines."""
    group_size: int = field(default=16, metadata={"min": 2})
    """G completions per prompt; group-relative advantages need at least 2."""
    prompts_per_step: int = field(default=64, metadata=POSITIVE)
    """Prompts per optimizer step over all data-parallel ranks (divisible by their number)."""
    max_new_tokens: int = field(default=8, metadata=POSITIVE)
    """The longest completion in tokens; one that reaches it without an EOS is truncated
    (training/truncated_fraction)."""
    temperature: float = field(default=1.0, metadata={"min": 0.0})
    """Sampling temperature of the training rollouts (behaviour log-probs are the
    temperature-1 log-probs whatever it is)."""
    max_off_policy_steps: int = field(default=0, metadata=NON_NEGATIVE)
    """0: each step samples, trains, then pushes the weights (on-policy). k > 0: a background
    thread samples the coming steps while the learner trains, from weights at most k policy
    versions old; it drains (on-policy again) after each checkpoint and evaluation, and a
    SIGTERM saves the rollouts sampled ahead, so a resume is exact. Staleness is reported as
    training/staleness_mean and _max."""
    stale_logprob_mismatch: bool = True
    """k > 0: report training/logprob_mismatch on stale steps too, by keeping the weights each
    stale step was sampled from (a frozen copy of the model, sharded like it, plus one copy per
    further version in flight) and scoring the batch under them: one forward without gradient
    per stale step. false: reported on on-policy steps only."""
    dynamic_sampling: bool = False
    """DAPO's "dynamic sampling": a group whose rewards are all equal (zero advantage) is
    dropped and more prompts are sampled, round after round, until every data-parallel rank
    holds its share of `prompts_per_step` groups with a learning signal (the ranks agree on
    the rounds), at most `max_sampling_rounds` (then the rest of a share is made of dropped
    groups, as plain GRPO would train them). The data moves `prompts_per_step` prompts per
    round, saved with each checkpoint: a resume is exact. Logged as training/sampling_rounds
    and training/groups_dropped (useful groups beyond a full share: training/groups_surplus).
    Needs max_off_policy_steps = 0."""
    max_sampling_rounds: int = field(default=10, metadata=POSITIVE)
    """dynamic_sampling: the most rounds of `prompts_per_step` prompts one step samples
    (verl's `max_num_gen_batches`)."""
    overlong_buffer: int = field(default=0, metadata=NON_NEGATIVE)
    """DAPO's "overlong reward shaping" ("soft overlong punishment"): with N > 0, a completion
    of L tokens loses (L - (max_new_tokens - N)) / N x overlong_penalty of its reward when
    L > max_new_tokens - N (0 below): a linear ramp over the last N tokens. 0: off."""
    overlong_penalty: float = field(default=1.0, metadata={"min": 0.0})
    """The reward lost at max_new_tokens (verl's `overlong_buffer.penalty_factor`)."""
    model_path: str | None = None
    """vllm only: the HF directory (config.json + safetensors) the engines start from; default:
    [model] hf_checkpoint, else (a model built from scratch) the learner's config.json on
    vLLM's dummy weights. Its parameter shapes must be the learner's; the learner's weights
    replace its own before the first rollout."""
    vllm: dict[str, Any] = field(default_factory=dict)
    """vllm only: the engines' table, [rollout.vllm]: our keys (weight_transfer, servers,
    token_file, sleep_level) and keyword arguments of `vllm.LLM`."""


@dataclass
class TokenizerSection:
    path: str | None = None
    """A directory with tokenizer.json / tokenizer_config.json; default: [model] hf_checkpoint.
    Relative paths (here and in [data], [[reward]]) are relative to the config file."""
    chat_template: str = "auto"
    """auto: the tokenizer's own chat template (an error if it has none); none: the prompt text
    as is (the tokenizer adds its special tokens); or a .jinja file."""
    skip_special_tokens: bool = True
    """Drop special tokens when completions are decoded for rewards and logs."""


@dataclass
class DataSection:
    train_files: list[str] = field(default_factory=list)
    """Local JSONL, JSON (an array of objects) or Parquet files of prompts."""
    eval_files: list[str] = field(default_factory=list)
    """Prompt files of the evaluation, in train_files' format; none: no evaluation."""
    prompt_key: str = "prompt"
    """The column holding the prompt text (rendered as one user message)."""
    messages_key: str | None = None
    """Instead of prompt_key: a column holding a chat, [{"role": ..., "content": ...}, ...]."""
    answer_key: str = "answer"
    """The column rewards compare against (any value; rows without it are an error)."""
    system_prompt: str | None = None
    """A system message before every prompt (through the chat template)."""
    max_prompt_tokens: int = field(default=1024, metadata=POSITIVE)
    """The longest prompt in tokens after the chat template (see overlong); with
    max_new_tokens it sizes the engines' context."""
    overlong: Literal["error", "skip"] = "error"
    """A prompt longer than max_prompt_tokens: stop with its row number, or skip it (counted)."""


@dataclass
class RewardSection:
    function: str = ""
    """A built-in (math, exact_match, regex) or a user function "file.py:name" /
    "package.module:name" with signature score(prompt: str, completion: str, row: dict) -> float.
    Exactly one of function, model and judge."""
    model: str | None = None
    """A Hugging Face AutoModelForSequenceClassification directory (num_labels 1, its tokenizer
    with a chat template beside it): the prompt and the completion, as text, rendered through
    its own chat template and scored in batches. Exactly one of function, model and judge."""
    judge: dict[str, Any] = field(default_factory=dict)
    """An LLM judge behind an OpenAI-compatible endpoint: { base_url, model, prompt (a .jinja
    file: prompt, completion, answer, row), parse (a regex whose one group is the score),
    temperature, max_tokens, concurrency, retries, api_key_env }; timeout_s is each request's
    total deadline. base_url is reached through HTTP_PROXY / HTTPS_PROXY (an http:// proxy)
    unless NO_PROXY names its host, as urllib does."""
    name: str | None = None
    """Its name in the metrics (training/reward/<name>_mean); default: the function's, the
    model directory's name, or "judge"."""
    weight: float = 1.0
    """Its weight in the completion's reward: the weighted sum of every [[reward]]."""
    timeout_s: float = field(default=10.0, metadata={"min": 0.001})
    """Seconds one call may take; a call that overruns is an error (see on_error). A judge's
    call is one request, and the deadline is total: connect (through a proxy too), send and the
    whole reply, however slowly it arrives; a request cut at it is tried again up to retries
    times, so a completion costs at most (retries + 1) x timeout_s plus the backoff (0.5 s, then
    1 s, 2 s, ...)."""
    on_error: Literal["raise", "zero"] = "raise"
    """raise: a reward that raises, hangs or returns a non-finite value stops the job with one
    line; zero: it scores 0 and is counted in training/reward_errors."""
    max_error_fraction: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})
    """With on_error = "zero": more errors than this fraction of a step's completions stop the
    job with one line (a reward broken on every row would otherwise train on zeros)."""
    pattern: str | None = None
    """regex only: the pattern the completion must match."""
    mode: Literal["search", "fullmatch"] = "search"
    """regex only: anywhere in the completion, or the whole completion."""
    credit: float = 1.0
    """regex only: the reward of a match (e.g. 0.1 for a format reward)."""
    workers: int | None = field(default=None, metadata=NON_NEGATIVE)
    """function only: processes that score completions in parallel, each call still timed out
    (a worker that overruns is replaced); default min(8, cores); 0: in this process, in a
    thread (a hung call is then abandoned, not stopped)."""
    batch_size: int = field(default=8, metadata=POSITIVE)
    """model only: completions per forward of the reward model."""
    device: str = "learner"
    """model only: learner (the learner's device on each rank), cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """model only: the reward model's weights and compute dtype."""
    max_length: int = field(default=1024, metadata={"min": 2})
    """model only: tokens of a rendered (prompt, completion) pair; a longer one loses the start
    of its prompt (counted in training/reward/<name>_truncated)."""
    normalize: Literal["none", "running"] = "none"
    """running: the score minus its running mean over every scored completion (all ranks), over
    its running standard deviation; the statistics are kept in the checkpoint."""


@dataclass
class EnvSection:
    """Multi-turn episodes (titan_learner.env): the model's turn, then the environment's
    (tool results, a user simulator's reply), until the episode is done. Set by `class` or
    by [[tool]] alone (the built-in tool environment); neither: one turn, the single-turn job."""

    class_: str | None = field(default=None, metadata={"key": "class"})
    """A user environment "file.py:Name" / "package.module:Name": a class built with no
    arguments, with reset(row) -> list of messages (the first prompt) and step(messages,
    completion) -> (new messages, reward or None, done). Unset with [[tool]]: the built-in tool
    environment (the row's prompt; tool calls answered; done at the first turn without one)."""
    max_turns: int = field(default=4, metadata=POSITIVE)
    """The most model turns of an episode; one that is not done after them is truncated."""
    max_total_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """The longest episode in tokens, prompt, sampled and environment tokens together; a turn
    is cut to what is left, and an episode that reaches it is truncated. 0: [data]
    max_prompt_tokens + max_turns x [rollout] max_new_tokens."""
    step_timeout_s: float = field(default=10.0, metadata={"min": 0.001})
    """Seconds one environment step or tool call may take; a tool call that overruns answers
    the model with an error tool message, an environment step that overruns truncates the
    episode."""
    tool_workers: int = field(default=8, metadata=POSITIVE)
    """Threads answering the tool calls of a turn's episodes at once (tools that wait on the
    network, a sandbox or an index); 1 for tools that are not thread-safe. Answers keep their
    calls' order; environment steps run one after another."""
    tool_parser: str = "auto"
    """How tool calls are read from a completion: hermes (Qwen3's <tool_call>{json}</tool_call>),
    llama3 (a bare {"name": ..., "parameters": ...} JSON object), auto (hermes when the chat
    template mentions <tool_call>, else llama3), or a user function "file.py:name" /
    "package.module:name" taking the completion text and returning a list of {"name": ...,
    "arguments": {...}}."""


@dataclass
class ToolSection:
    function: str = ""
    """A plain Python function "file.py:name" / "package.module:name" the model may call; its
    JSON schema (the chat template's tools=) comes from its signature's type hints and its
    docstring (the first paragraph describes it, "name: meaning" lines its arguments)."""


@dataclass
class EvalSection:
    every_steps: int = field(default=0, metadata=NON_NEGATIVE)
    """With eval_files: evaluate at step 0, every N steps (0: only then and at the end), and at
    the end."""
    samples_per_prompt: int = field(default=4, metadata=POSITIVE)
    """k: pass@k is estimated from k samples per prompt."""
    temperature: float = field(default=1.0, metadata={"min": 0.0})
    """Sampling temperature of the evaluation."""
    max_new_tokens: int = field(default=0, metadata=NON_NEGATIVE)
    """0: [rollout] max_new_tokens."""
    max_prompts: int = field(default=0, metadata=NON_NEGATIVE)
    """0: every eval prompt."""
    pass_threshold: float = 1.0
    """A sample passes when its total reward reaches this."""


@dataclass
class CheckpointSection:
    interval: int = field(default=0, metadata=NON_NEGATIVE)
    """Save every N steps and at the last step (0: never)."""
    keep_latest_k: int = field(default=2, metadata=POSITIVE)
    """Committed checkpoints kept: older ones are deleted after each save commits."""
    async_save: bool = False
    """Save in the background (DCP's async save of a copy of the state): the step
    blocks only for the copy; the next save waits for the previous one to commit."""
    export_hf: bool = False
    """Also write `step-<N>/hf` beside each step saved every `interval`: what `titan-learner
    export` writes (a directory transformers and `vllm serve` load as it is), in a process of
    its own that runs alongside training with async_save and before the next step otherwise.
    (The save a SIGTERM makes is not exported: its grace period is for the checkpoint.)"""


@dataclass
class RunSection:
    seed: int = field(default=0, metadata={"min": 0, "max": 2**31 - 1})
    """Seeds every random stream of the run (derived seeds must fit torch's 64 bits)."""
    steps: int = field(default=10, metadata=POSITIVE)
    """Optimizer steps of the run (also the horizon of [lr_scheduler] decay)."""
    output_dir: str = "outputs/run"
    """Where the run writes metrics.jsonl, samples.jsonl, eval/, checkpoints/ and
    curves.png; the run owns it while it runs (a lock)."""
    batch_size: int = field(default=8, metadata=POSITIVE)
    """Sequences per rank per update of the benchmarks' synthetic batches (benchmarks/bench_*.py);
    the GRPO job sizes its batches from [rollout]."""
    seq_len: int = field(default=32, metadata={"min": 2})
    """Longest row of the benchmarks' synthetic batches (benchmarks/bench_*.py), and TorchTitan's
    TrainingConfig.seq_len; the GRPO job sizes its rows from [data] and [rollout]."""
    log_samples_every: int = field(default=10, metadata=NON_NEGATIVE)
    """Every N steps, a few (prompt, completion, rewards) rows to samples.jsonl (0: never)."""
    lock_stale_after_s: float = field(default=300.0, metadata={"min": 10.0})
    """A lock left on another host whose heartbeat (refreshed every 30 s, or a third of this)
    is older than this is a crashed run's, which a resuming run takes over."""


@dataclass
class WandbSection:
    """[logging] wandb = { project = "...", ... }: the run's metrics in Weights & Biases too."""

    project: str | None = None
    """Unset: W&B's default project."""
    entity: str | None = None
    """The team or user; unset: W&B's default entity of the logged-in user."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """offline: written under <output_dir>/wandb for `wandb sync` later; disabled: no run."""
    name: str | None = None
    """The run's display name; unset: W&B picks one."""
    tags: list[str] = field(default_factory=list)
    """Labels to filter runs by in the W&B UI."""


@dataclass
class LoggingSection:
    log_every: int = field(default=1, metadata=POSITIVE)
    """Off a terminal (a log file, CI): the plain metrics line every N steps (and always the
    last). On a terminal the progress bar shows every step; `--verbose` adds the line there."""
    wandb: WandbSection | None = None
    """Unset: no Weights & Biases run (needs `pip install "titan_learner[wandb]"`)."""


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    activation_checkpoint: ActivationCheckpointSection = field(
        default_factory=ActivationCheckpointSection
    )
    compile: CompileSection = field(default_factory=CompileSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    loss: LossSection = field(default_factory=LossSection)
    kl: KLSection = field(default_factory=KLSection)
    advantage: AdvantageSection = field(default_factory=AdvantageSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    reward: list[RewardSection] = field(default_factory=list)
    env: EnvSection = field(default_factory=EnvSection)
    tool: list[ToolSection] = field(default_factory=list)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    source: str = "<config>"


SECTIONS = tuple(name for name in Config.__dataclass_fields__ if name != "source")
ARRAY_SECTIONS = ("reward", "tool")
"""Sections written as arrays of tables ([[reward]], [[tool]])."""
