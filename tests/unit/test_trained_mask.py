"""`batch.trained_mask`: the batch check and the loss share one mask per batch, never a stale one."""

from __future__ import annotations

import math

import torch

from titan_learner.learner.batch import trained_mask


def parts() -> tuple[torch.Tensor, torch.Tensor]:
    assistant = torch.tensor([[False, True, True, True], [False, False, True, True]])
    log_probs = torch.tensor(
        [[math.nan, -0.5, math.nan, -1.0], [math.nan, math.nan, -0.2, -math.inf]]
    )
    return assistant, log_probs


def test_the_same_tensors_get_the_same_mask():
    assistant, log_probs = parts()
    first = trained_mask(assistant, log_probs)
    expected = torch.tensor([[False, True, False, True], [False, False, True, False]])
    assert torch.equal(first, expected)
    assert trained_mask(assistant, log_probs) is first


def test_a_tensor_written_in_place_or_another_tensor_is_masked_again():
    assistant, log_probs = parts()
    first = trained_mask(assistant, log_probs)
    log_probs[0, 1] = math.nan  # the behaviour log-prob of a trained token goes missing
    second = trained_mask(assistant, log_probs)
    assert second is not first and not second[0, 1]
    assistant[1, 2] = False
    assert not trained_mask(assistant, log_probs)[1, 2]
    other = log_probs.clone()
    assert trained_mask(assistant, other) is not trained_mask(assistant, log_probs)
    mask = trained_mask(assistant, log_probs)
    mask.fill_(True)  # a caller that edits the mask in place does not poison the next call
    assert torch.equal(trained_mask(assistant, log_probs), assistant & log_probs.isfinite())


def test_inference_tensors_are_masked_every_time():
    with torch.inference_mode():
        assistant, log_probs = parts()
        first = trained_mask(assistant, log_probs)
        assert trained_mask(assistant, log_probs) is not first
        assert torch.equal(first, assistant & log_probs.isfinite())
