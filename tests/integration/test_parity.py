"""Sharded learners equal the one-process LocalLearner: losses, grad norms, gathered weights.

One spawned gloo world per size runs every layout of that size, so each world is paid once.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.support.models import batches, tiny_config, with_ref_log_probs
from tests.support.scenarios import (
    LORA,
    STEPS,
    capture_gradients,
    frozen_base,
    lora_checks,
    loss_parameter_rejected,
    run_layouts,
)
from tests.support.worlds import run_world
from titan_learner.learner.local import LocalLearner
from titan_learner.learner.loss.correction import CORRECTION_METRICS

TOL = 1e-5
COMPARED = (
    "loss_objective",
    "loss_entropy",
    "entropy",  # token means, whatever the padding (losses.TokenMeanDiagnostics)
    "clip_fraction",
    "clip_fraction_low",  # token means too: the sides add up over ranks like the whole
    "clip_fraction_high",
    "kl_approx",
    "grad_norm",
    "logprob_mismatch",  # token-weighted over ranks
    "logprob_mismatch_max",  # MAX over ranks
)

WORLD2 = {
    "dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}},
    "tp=2": {"sections": {"parallelism": {"tp": 2, "dp_shard": 1}}},
    "dp_replicate=2": {"sections": {"parallelism": {"dp_replicate": 2, "dp_shard": 1}}},
    "dp_shard=2 full AC": {
        "sections": {"parallelism": {"dp_shard": 2}, "activation_checkpoint": {"mode": "full"}}
    },
    "dp_shard=2 selective AC": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "activation_checkpoint": {"mode": "selective"},
        }
    },
    "qwen3 dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}, "model": "qwen3"},
    "qwen3 tp=2": {"sections": {"parallelism": {"tp": 2, "dp_shard": 1}}, "model": "qwen3"},
    "dp_shard=2 accumulate 2": {
        "sections": {"parallelism": {"dp_shard": 2}, "learner": {"grad_accum_steps": 2}},
        "accumulate": True,
    },
    # Rows that train different numbers of tokens (1 to 15): the step's mean is over all of
    # them, however the ranks and micro-batches split it.
    "varied dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}, "varied": True},
    "varied dp_shard=2 accumulate 2": {
        "sections": {"parallelism": {"dp_shard": 2}, "learner": {"grad_accum_steps": 2}},
        "accumulate": True,
        "varied": True,
    },
    "varied prompt_mean dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"aggregation": "prompt_mean"},
        },
        "accumulate": True,
        "varied": True,
    },
    # Token-budget micro-batches: each rank packs its rows by length into micro-batches of at
    # most 32 positions (its own count; the ranks run the most any of them needs).
    "varied token budget dp_shard=2": {
        "sections": {"parallelism": {"dp_shard": 2}, "learner": {"max_tokens_per_microbatch": 32}},
        "varied": True,
    },
    "varied prompt_mean token budget dp_shard=2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"max_tokens_per_microbatch": 32},
            "loss": {"aggregation": "prompt_mean"},
        },
        "varied": True,
    },
    # Rollout-shaped batches (groups of rows sharing a prompt): each prompt runs once per
    # group, on a stream of the needed tokens; against the unshared one-process reference.
    "grouped shared prompts dp_shard=2": {
        "sections": {"parallelism": {"dp_shard": 2}, "learner": {"share_prompts": True}},
        "grouped": True,
    },
    "grouped shared prompts dp_shard=2 full AC": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "activation_checkpoint": {"mode": "full"},
            "learner": {"share_prompts": True},
        },
        "grouped": True,
    },
    "grouped shared prompts tp=2": {
        "sections": {"parallelism": {"tp": 2, "dp_shard": 1}, "learner": {"share_prompts": True}},
        "grouped": True,
    },
    # Rank 0's loss is NaN at step 1: both ranks drop that step, and only that step.
    "poisoned dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}}, "poisoned_step": 1},
    # MiniMax-M1's CISPO, every clipped token keeping its gradient (the synthetic log-probs put
    # nearly all of them below 1 - 0.2): one token mean and clip fraction over ranks and
    # unequal micro-batches
    "varied cispo dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"name": "cispo", "clip_epsilon": [0.2, 0.28]},
        },
        "accumulate": True,
        "varied": True,
    },
    # The row-sum aggregations (rows counted over ranks and micro-batches), GSPO's sequence
    # ratio (rows of other lengths on each rank) and an IcePop-like token mask (its fractions
    # and ratio mean token-weighted over ranks, its ratio max the max)
    "varied seq_mean_token_sum dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"aggregation": "seq_mean_token_sum"},
        },
        "accumulate": True,
        "varied": True,
    },
    "varied seq_mean_token_sum_norm dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"aggregation": "seq_mean_token_sum_norm"},
        },
        "accumulate": True,
        "varied": True,
    },
    "varied gspo dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"name": "gspo", "clip_epsilon": [0.2, 0.28]},
        },
        "accumulate": True,
        "varied": True,
    },
    "varied correction dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"correction": {"mode": "mask", "low": 0.5, "high": 2.0}},
        },
        "accumulate": True,
        "varied": True,
    },
    "varied kl dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"kl_to_ref_coeff": 0.1},
        },
        "accumulate": True,
        "varied": True,
    },
    "varied kl_k2 dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"kl_to_ref_coeff": 0.1},
            "kl": {"estimator": "k2"},
        },
        "accumulate": True,
        "varied": True,
    },
    # LoRA (every Linear but the head): the adapters sharded by the model's own plan, their
    # gradients reduced over ranks and micro-batches, the base never touched.
    "lora dp_shard=2": {"sections": {"parallelism": {"dp_shard": 2}, "model": {"lora": LORA}}},
    "lora varied dp_shard=2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "model": {"lora": LORA},
        },
        "accumulate": True,
        "varied": True,
    },
}
WORLD4 = {
    "dp_shard=2 x tp=2": {"sections": {"parallelism": {"dp_shard": 2, "tp": 2}}},
    "varied dp_shard=2 x tp=2 accumulate 2": {
        "sections": {"parallelism": {"dp_shard": 2, "tp": 2}, "learner": {"grad_accum_steps": 2}},
        "accumulate": True,
        "varied": True,
    },
    "varied HSDP 2x2": {
        "sections": {"parallelism": {"dp_replicate": 2, "dp_shard": 2}},
        "varied": True,
    },
    "varied prompt_mean HSDP 2x2 accumulate 2": {
        "sections": {
            "parallelism": {"dp_replicate": 2, "dp_shard": 2},
            "learner": {"grad_accum_steps": 2},
            "loss": {"aggregation": "prompt_mean"},
        },
        "accumulate": True,
        "varied": True,
    },
    "qwen3 dp_shard=2 x tp=2": {
        "sections": {"parallelism": {"dp_shard": 2, "tp": 2}},
        "model": "qwen3",
    },
    "lora dp_shard=2 x tp=2": {
        "sections": {"parallelism": {"dp_shard": 2, "tp": 2}, "model": {"lora": LORA}},
    },
    "lora varied HSDP 2x2": {
        "sections": {
            "parallelism": {"dp_replicate": 2, "dp_shard": 2},
            "model": {"lora": LORA},
        },
        "varied": True,
    },
}


def local_run(
    model: str,
    varied: bool = False,
    sections: dict | None = None,
    grouped: bool = False,
    skipped: int | None = None,
) -> dict:
    """The one-process reference: one update per global batch (prompts never shared), but
    the `skipped`-th. With [model.lora], also each step's gradients and the base's fate."""
    learner = LocalLearner(tiny_config(model, **(sections or {})))
    lora = learner.config.model.lora is not None
    if lora:
        base_before, gradients = frozen_base(learner), capture_gradients(learner)
    steps = batches(STEPS, varied=varied, grouped=grouped)
    steps = [batch for i, batch in enumerate(steps) if i != skipped]
    if learner.config.loss.kwargs.get("kl_to_ref_coeff"):
        steps = [with_ref_log_probs(batch) for batch in steps]
    metrics = [dict(learner.update(batch).items()) for batch in steps]
    return {
        "metrics": [{k: float(v) for k, v in m.items()} for m in metrics],
        "weights": dict(learner.get_weights(dtype=torch.float32).items()),
        **(lora_checks(learner, base_before, gradients) if lora else {}),
    }


@pytest.fixture(scope="module")
def reference():
    return local_run("llama3")


@pytest.fixture(scope="module")
def qwen3_reference():
    return local_run("qwen3")


def reference_for(layout: str, reference, qwen3_reference):
    if layout.startswith("lora"):
        return lora_reference(" varied " in layout)
    if layout.startswith("grouped"):
        return grouped_reference()
    if layout.startswith("varied"):
        return varied_reference(layout)
    return qwen3_reference if layout.startswith("qwen3") else reference


VARIED_SECTIONS = {
    "prompt_mean": {"loss": {"aggregation": "prompt_mean"}},
    "seq_mean_token_sum": {"loss": {"aggregation": "seq_mean_token_sum"}},
    "seq_mean_token_sum_norm": {"loss": {"aggregation": "seq_mean_token_sum_norm"}},
    "gspo": {"loss": {"name": "gspo", "clip_epsilon": [0.2, 0.28]}},
    "correction": {"loss": {"correction": {"mode": "mask", "low": 0.5, "high": 2.0}}},
    "kl": {"loss": {"kl_to_ref_coeff": 0.1}},
    "kl_k2": {"loss": {"kl_to_ref_coeff": 0.1}, "kl": {"estimator": "k2"}},
    "cispo": {"loss": {"name": "cispo", "clip_epsilon": [0.2, 0.28]}},
}


@functools.cache
def grouped_reference() -> dict:
    """The one-process run on the grouped batches, each row computing its own prompt."""
    return local_run("llama3", grouped=True)


@functools.cache
def varied_reference(layout: str) -> dict:
    """The one-process run on the varied batches, with the layout's loss (and KL) sections."""
    sections = next((v for k, v in VARIED_SECTIONS.items() if f" {k} " in f" {layout} "), {})
    return local_run("llama3", varied=True, sections=sections)


@functools.cache
def lora_reference(varied: bool) -> dict:
    """The one-process LoRA run: adapters, gradients and base to compare every layout with."""
    return local_run("llama3", varied=varied, sections={"model": {"lora": LORA}})


@pytest.fixture(scope="module")
def lora_saved(tmp_path_factory):
    """Where the dp_shard=2 LoRA layout saves its checkpoint after its steps."""
    return str(tmp_path_factory.mktemp("lora_dp_shard_2"))


@pytest.fixture(scope="module")
def world2(lora_saved):
    layouts = {**WORLD2, "lora dp_shard=2": {**WORLD2["lora dp_shard=2"], "save_to": lora_saved}}
    return run_world(2, run_layouts, layouts)


@pytest.fixture(scope="module")
def world4():
    return run_world(4, run_layouts, WORLD4)


def assert_matches(result, reference, compared=COMPARED):
    for step, (got, want) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
        for key in compared:
            assert got[key] == pytest.approx(want[key], abs=TOL), (step, key)
    assert set(result["weights"]) == set(reference["weights"])
    for name, want in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], want, atol=TOL, rtol=0, msg=name)


def test_one_process_titan_learner_matches_local(reference):
    layouts = {
        "llama3": {"sections": {}},
        "qwen3": {"sections": {}, "model": "qwen3"},
        "compiled": {"sections": {"compile": {"enable": True}}},
        "varied accumulate 2": {
            "sections": {"learner": {"grad_accum_steps": 2}},
            "accumulate": True,
            "varied": True,
        },
        "varied token budget": {
            "sections": {"learner": {"max_tokens_per_microbatch": 24}},
            "varied": True,
        },
        "grouped shared prompts": {
            "sections": {"learner": {"share_prompts": True}},
            "grouped": True,
        },
        "grouped shared prompts compiled": {
            "sections": {"compile": {"enable": True}, "learner": {"share_prompts": True}},
            "grouped": True,
        },
        # micro-batches sorted by length: groups split, rows share where neighbours agree
        "grouped shared prompts token budget": {
            "sections": {"learner": {"share_prompts": True, "max_tokens_per_microbatch": 32}},
            "grouped": True,
        },
    }
    [result] = run_world(1, run_layouts, layouts)
    assert_matches(result["varied accumulate 2"], varied_reference("varied accumulate 2"))
    assert_matches(result["varied token budget"], varied_reference("varied token budget"))
    assert_matches(result["grouped shared prompts"], grouped_reference())
    assert_matches(result["grouped shared prompts token budget"], grouped_reference())
    assert_matches(result["grouped shared prompts compiled"], grouped_reference())
    assert_matches(result["llama3"], reference)
    assert_matches(result["compiled"], reference)  # per-block torch.compile, HF names exported
    assert_matches(result["qwen3"], local_run("qwen3"))
    assert result["llama3"]["capabilities"].sharded


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [name for name in WORLD2 if name != "poisoned dp_shard=2" and not name.startswith("lora")],
)
def test_two_process_layouts_match_local(world2, reference, qwen3_reference, layout):
    reference = reference_for(layout, reference, qwen3_reference)
    rank0, rank1 = world2
    # With accumulation the stepping call reports the whole window's loss terms.
    kl = " kl " in layout or " kl_k2 " in layout
    compared = COMPARED + (("loss_kl_to_ref",) if kl else ())
    if " kl_k2 " in layout:  # the estimator is in force on both sides: k2 is not k3's value
        k3 = varied_reference("varied kl dp_shard=2 accumulate 2")["metrics"]
        pairs = zip(reference["metrics"], k3, strict=True)
        assert all(a["loss_kl_to_ref"] != b["loss_kl_to_ref"] for a, b in pairs)
    if " correction " in layout:
        compared += CORRECTION_METRICS
        masked = [m["correction/masked_fraction"] for m in reference["metrics"]]
        assert all(0 < share < 1 for share in masked), "the layout must mask some tokens"
    assert_matches(rank0[layout], reference, compared)
    assert rank1[layout]["weights"] == {}, "get_weights() must be empty off rank 0"
    # every rank reports the same data-parallel-averaged metrics
    assert rank0[layout]["metrics"] == rank1[layout]["metrics"]


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_drops_that_step_on_every_rank(world2):
    """Rank 0's loss is NaN at step 1: both ranks skip its optimizer step and report its loss
    terms as NaN; the other steps equal the one-process run without that batch."""
    rank0, rank1 = (rank["poisoned dp_shard=2"] for rank in world2)
    for mine, theirs in zip(rank0["metrics"], rank1["metrics"], strict=True):
        assert mine == pytest.approx(theirs, nan_ok=True)  # the same on every rank, NaN too
    dropped = rank0["metrics"][1]
    assert "grad_norm" not in dropped and dropped["skipped_nonfinite_steps"] == 1
    assert all(math.isnan(v) for k, v in dropped.items() if k.startswith("loss")), dropped
    assert all(math.isfinite(v) for k, v in dropped.items() if not k.startswith("loss"))
    kept = {**rank0, "metrics": [rank0["metrics"][0], rank0["metrics"][2]]}
    assert_matches(kept, local_run("llama3", skipped=1))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in WORLD4 if name.startswith("varied")])
def test_unequal_token_counts_on_four_processes_match_local(world4, layout):
    assert_matches(world4[0][layout], varied_reference(layout))
    assert all(rank[layout]["metrics"] == world4[0][layout]["metrics"] for rank in world4)


@pytest.mark.slow
def test_fsdp_x_tp_on_four_processes_matches_local(world4, reference, qwen3_reference):
    assert_matches(world4[0]["dp_shard=2 x tp=2"], reference)
    assert_matches(world4[0]["qwen3 dp_shard=2 x tp=2"], qwen3_reference)
    capabilities = world4[0]["dp_shard=2 x tp=2"]["capabilities"]
    assert (capabilities.data_parallel_size, capabilities.tensor_parallel_size) == (2, 2)


@pytest.mark.slow
def test_trainable_loss_parameters_are_rejected_under_data_parallelism():
    messages = run_world(2, loss_parameter_rejected)
    for message in messages:
        assert message.startswith("the loss module has trainable parameters of its own (scale)")
        assert "with 2 data-parallel ranks their gradients would not be synchronized" in message


LORA_LAYOUTS = [(2, name) for name in WORLD2 if name.startswith("lora")] + [
    (4, name) for name in WORLD4 if name.startswith("lora")
]


@pytest.mark.slow
@pytest.mark.parametrize(("size", "layout"), LORA_LAYOUTS)
def test_lora_layouts_match_local_in_value_and_every_adapter_gradient(world2, world4, size, layout):
    """A LoRA step under FSDP, accumulation, dp x tp and HSDP equals the one-process LoRA step:
    metrics, merged weights, each adapter's gradient at every step; the base stays bit-identical
    on every rank, and the optimizer holds the adapters alone."""
    world = world2 if size == 2 else world4
    reference = lora_reference(" varied " in layout)
    result = world[0][layout]
    assert_matches(result, reference)
    adapters = sorted(reference["gradients"][0])
    assert adapters and all(".lora_a." in n or ".lora_b." in n for n in adapters)
    assert result["optimized"] == reference["optimized"] == adapters
    assert len(result["gradients"]) == len(reference["gradients"]) == STEPS
    for step, (got, want) in enumerate(
        zip(result["gradients"], reference["gradients"], strict=True)
    ):
        assert sorted(got) == adapters
        for name in adapters:
            torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=0, msg=(step, name))
    # B starts at zero, so A's first gradient is zero; from step 2 on both move
    assert all(float(g.abs().max()) > 0 for g in reference["gradients"][1].values())
    assert all(rank[layout]["base_unchanged"] for rank in world)


@pytest.mark.slow
def test_a_lora_checkpoint_of_two_ranks_resumes_exactly_on_one_process(world2, lora_saved):
    """Resharded by DCP from dp_shard=2 into a one-process learner: the adapters, the step and
    the next update equal those of the one-process run that trained alone."""
    learner = LocalLearner(tiny_config(model={"lora": LORA}))
    learner.load(lora_saved)
    assert learner.step == STEPS
    saved = world2[0]["lora dp_shard=2"]["weights"]
    for name, tensor in learner.get_weights(dtype=torch.float32).items():
        assert torch.equal(tensor, saved[name]), name
    alone = LocalLearner(tiny_config(model={"lora": LORA}))
    for batch in batches(STEPS):
        alone.update(batch)
    following = batches(STEPS + 1, seed=1)[-1]
    got, want = learner.update(following.clone()), alone.update(following.clone())
    for key in ("loss_objective", "grad_norm"):
        assert float(got[key]) == pytest.approx(float(want[key]), abs=TOL), key
