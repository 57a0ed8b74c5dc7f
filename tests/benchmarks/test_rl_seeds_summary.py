"""``rl_seeds_summary.py`` (README: the multi-seed summary of ``gpu_rl_seeds.sh``): per-seed numbers of the table."""

from __future__ import annotations


def test_reward_columns_average_the_rewards_there_are(bench_module):
    mod = bench_module("rl_seeds_summary")
    rows = [{"step": i, "reward": 0.1 * (i + 1), "mismatch/logprob_abs_diff": 0.01} for i in range(8)]
    one = mod.per_seed(rows)
    assert abs(one["reward_first5"] - 0.3) < 1e-12 and abs(one["reward_last5"] - 0.6) < 1e-12
    # a row without a reward was counted as a reward of 0 among the first five (the sum was divided by 5)
    rows[2] = {"step": 2, "mismatch/logprob_abs_diff": 0.01}
    assert abs(mod.per_seed(rows)["reward_first5"] - (0.1 + 0.2 + 0.4 + 0.5 + 0.6) / 5) < 1e-12
    # no reward at all: "-" in the table, not 0 +- 0
    bare = [{"step": i, "mismatch/logprob_abs_diff": 0.01} for i in range(6)]
    assert mod.per_seed(bare)["reward_first5"] is None and mod.per_seed(bare)["reward_last5"] is None
    assert mod.per_seed(rows[:3])["reward_first5"] == (0.1 + 0.2) / 2  # fewer than five rows: their mean
