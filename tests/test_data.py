"""Samplers: deterministic, resumable, split across ranks; RepeatSampler for GRPO."""

import pytest

from treadle.data import RepeatSampler, SeededSampler, require_columns


def test_seeded_sampler_is_a_function_of_seed_and_epoch():
    a, b = SeededSampler(10, seed=1), SeededSampler(10, seed=1)
    assert list(a) == list(b) and sorted(a) == list(range(10))
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(10))


def test_seeded_sampler_skips_without_changing_the_order():
    s = SeededSampler(10, seed=1)
    s.set_epoch(2)
    full = list(s)
    s.start_epoch(2, skip=4)
    assert list(s) == full[4:] and len(s) == 6


def test_seeded_sampler_splits_across_ranks_and_pads():
    ranks = [SeededSampler(5, seed=0, shuffle=False, rank=r, world_size=2) for r in range(2)]
    assert [list(r) for r in ranks] == [[0, 2, 4], [1, 3, 0]]


def test_repeat_sampler_groups_and_repeats():
    s = RepeatSampler(4, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False)
    assert list(s) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3] and len(s) == 16


def test_repeat_sampler_same_prompts_on_every_rank():
    ranks = [list(RepeatSampler(6, mini_repeat_count=3, batch_size=2, shuffle=True, seed=5, rank=r, world_size=2))
             for r in range(2)]
    merged = [ranks[r][i * 3:(i + 1) * 3] for i in range(len(ranks[0]) // 3) for r in range(2)]
    flat = [x for chunk in merged for x in chunk]
    assert all(len(set(flat[i:i + 3])) == 1 for i in range(0, len(flat), 3))  # groups stay whole across ranks
    assert sorted(set(flat)) == list(range(6))


def test_repeat_sampler_rejects_uneven_splits():
    with pytest.raises(ValueError, match="cannot be split evenly over 4 ranks"):
        RepeatSampler(8, mini_repeat_count=3, batch_size=2, world_size=4)


def test_require_columns_names_what_is_missing():
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"needs column\(s\) \['chosen'\] but the dataset has \['prompt'\]"):
        require_columns(Dataset.from_list([{"prompt": "x"}]), ["prompt", "chosen"], what="DPOTrainer")
