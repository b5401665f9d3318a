"""Which GPU a rank takes (titan_learner.ranks.local_cuda_index), as TorchTitan's
`get_local_device` decides: LOCAL_RANK's, or the one GPU a launcher that masks each process
to its own (Slurm's --gpus-per-task) shows it, where LOCAL_RANK would name a device that
process cannot see ("invalid device ordinal" at torch.cuda.set_device)."""

from __future__ import annotations

import pytest

from titan_learner.ranks import local_cuda_index


@pytest.mark.parametrize(
    ("local_rank", "visible", "index"),
    [("3", 8, 3), ("0", 8, 0), ("3", 1, 0), ("0", 1, 0), (None, 4, 0)],
)
def test_a_rank_takes_its_local_rank_s_gpu_or_the_one_it_sees(
    local_rank, visible, index, monkeypatch
):
    if local_rank is None:  # a plain `python` run, no launcher
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert local_cuda_index(visible) == index


def test_a_local_rank_beyond_the_gpus_a_process_sees_is_one_line(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ValueError) as info:
        local_cuda_index(4)
    assert str(info.value) == (
        "LOCAL_RANK=5 and this process sees 4 GPUs; allowed: a LOCAL_RANK below the GPUs each "
        "process sees, or one GPU per process (CUDA_VISIBLE_DEVICES)"
    )
