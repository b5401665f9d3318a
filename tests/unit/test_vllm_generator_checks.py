"""What VLLMGenerator decides before it talks to vLLM: vLLM's sampling limits, non-colliding
request seeds, and which GPU a rank's colocated engine starts on."""

from __future__ import annotations

import os

import pytest
import torch

from titan_learner.vllm.generator import (
    check_vllm_sampling,
    engine_gpu,
    request_seeds,
    visible_gpu,
)


@pytest.mark.parametrize(
    ("group_size", "temperature", "message"),
    [
        (
            16,
            0.0,
            "temperature 0 is greedy decoding, which vLLM allows only for one completion "
            "per prompt, got 16; allowed: temperature > 0, or 1 completion per prompt",
        ),
        (1, 2.5, "temperature 2.5 is above vLLM's limit; allowed: 0 < temperature <= 2"),
    ],
)
def test_what_vllm_would_refuse_is_one_clear_error(group_size, temperature, message):
    with pytest.raises(ValueError) as info:
        check_vllm_sampling(group_size, temperature)
    assert str(info.value) == message


@pytest.mark.parametrize(("group_size", "temperature"), [(1, 0.0), (16, 1e-3), (4, 2.0)])
def test_what_vllm_accepts_passes(group_size, temperature):
    check_vllm_sampling(group_size, temperature)


def test_no_two_completions_of_a_rollout_share_a_seed():
    group_size = 16
    seeds = request_seeds(1000, 64, group_size)
    completion_seeds = [seed + j for seed in seeds for j in range(group_size)]  # vLLM's rule
    assert len(set(completion_seeds)) == 64 * group_size


@pytest.mark.parametrize(
    ("index", "visible", "expected"),
    [(0, None, "0"), (3, None, "3"), (1, "4,5,6", "5"), (0, " 7 ,2", "7"), (2, "", "2")],
)
def test_a_ranks_gpu_is_named_as_the_engine_process_will_see_it(index, visible, expected):
    assert visible_gpu(torch.device("cuda", index), visible) == expected


def test_a_gpu_outside_the_visible_ones_is_refused():
    with pytest.raises(ValueError, match=r"cuda:2 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        visible_gpu(torch.device("cuda", 2), "0,1")


def test_the_engine_sees_only_its_ranks_gpu_while_it_starts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with engine_gpu(torch.device("cuda", 1)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with engine_gpu(torch.device("cuda", 0)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with engine_gpu(torch.device("cpu")):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
