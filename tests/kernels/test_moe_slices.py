"""How many K slices the W4A16 GEMM takes by default (host logic: no GPU needed)."""

import pytest

pytest.importorskip("triton")
from megatron_trace.kernels import moe_slices  # noqa: E402


@pytest.mark.parametrize("rows, experts", [(1, 128), (8, 128), (64, 128), (512, 32), (3, 1)])
def test_expected_active_experts(rows, experts):
    """E (1 - (1 - 1/E)^rows), checked against the sum over experts of P(expert has a row)."""
    p_empty = ((experts - 1) / experts) ** rows  # an expert gets none of the rows
    assert moe_slices.expected_active(rows, experts) == pytest.approx(experts * (1 - p_empty), rel=1e-12)
    assert 0 < moe_slices.expected_active(rows, experts) <= min(rows, experts)


def test_pick_k_slices():
    sms, want = 132, moe_slices.PROGRAMS_PER_SM * 132
    # batch 1 of Qwen3-30B-A3B fc1: 8 active experts x 12 column tiles, K = 2048 in 16 tiles of 128
    s = moe_slices.pick_k_slices(96, 16, sms)
    assert 96 * s >= want or s == moe_slices.MAX_K_SLICES
    assert 16 % s == 0 and s > 1
    # enough programs already: no slices
    assert moe_slices.pick_k_slices(2 * want, 16, sms) == 1
    # fc2: K = 768 in 6 tiles: only 1, 2 or 3 slices of at least 2 tiles; on the full grid (4 tiles) none
    assert moe_slices.pick_k_slices(128, 6, sms) == 3
    assert moe_slices.pick_k_slices(128, 6, sms, min_tiles=moe_slices.MIN_TILES_PER_SLICE_FULL) == 1
    # fc1 at batch 4 on the full grid (29 active experts x 12 tiles): 2 slices of 8 tiles
    assert moe_slices.pick_k_slices(29 * 12, 16, sms, min_tiles=moe_slices.MIN_TILES_PER_SLICE_FULL) == 2
    # one K tile: nothing to slice
    assert moe_slices.pick_k_slices(1, 1, sms) == 1
    for programs in (1, 50, 200, 600, 5000):
        for k_tiles in (1, 2, 6, 16, 56):
            s = moe_slices.pick_k_slices(programs, k_tiles, sms)
            assert k_tiles % s == 0 and s <= moe_slices.MAX_K_SLICES
            assert s == 1 or k_tiles // s >= moe_slices.MIN_TILES_PER_SLICE


def test_check_k_slices():
    assert moe_slices.check_k_slices(4, 16) == 4
    with pytest.raises(ValueError, match=r"k_slices=5 must divide the 16 K tiles"):
        moe_slices.check_k_slices(5, 16)
    with pytest.raises(ValueError, match="k_slices=0"):
        moe_slices.check_k_slices(0, 16)


def test_compact_grid_only_for_few_active_experts():
    """Qwen3-30B-A3B (128 experts, top-8): batch 1 and 2 route to about 8 and 15 experts (compact grid), batch 4 to
    about 29 (full grid), as measured in session 15."""
    assert moe_slices.few_active(8, 128) and moe_slices.few_active(16, 128)
    assert not moe_slices.few_active(32, 128) and not moe_slices.few_active(1024, 128)


@pytest.mark.parametrize("bad", [2.0, "2", None])
def test_check_k_slices_refuses_a_non_int(bad):
    with pytest.raises(ValueError, match=rf"k_slices={bad!r} must divide the 16 K tiles of the config: one of "
                                         r"\[1, 2, 4, 8, 16\]"):
        moe_slices.check_k_slices(bad, 16)


def test_pick_k_slices_stops_at_the_first_count_that_reaches_the_target():
    """Exactly ``PROGRAMS_PER_SM`` x sms programs is enough: 264 programs x 2 slices on 132 SMs (not 4 slices)."""
    want = moe_slices.PROGRAMS_PER_SM * 132
    assert moe_slices.pick_k_slices(want // 2, 16, 132) == 2
    assert moe_slices.pick_k_slices(want // 2 - 1, 16, 132) == 4


def test_few_active_includes_the_share_itself():
    """One row over 8 experts: exactly 1/8 of them active, still the compact grid (``COMPACT_ACTIVE_SHARE``: up to)."""
    assert moe_slices.expected_active(1, 8) == 1.0 == moe_slices.COMPACT_ACTIVE_SHARE * 8
    assert moe_slices.few_active(1, 8)
    assert not moe_slices.few_active(2, 8)
