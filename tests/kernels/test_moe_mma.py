"""The CUDA FP4 grouped GEMM's host side on any machine: where it runs, how it is chosen, and its source ships with
the package (the kernel itself: tests/gpu/test_moe_mma_gpu.py)."""

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference, moe_mma


def _weight(e=4, n=64, k=512):
    return Quantizer("nvfp4").quantize(torch.randn(e, n, k) * 0.02)


def test_source_is_package_data():
    text = moe_mma.SOURCE.read_text()
    assert "fp4_w4a16_mma" in text and "mma.sync.aligned.m16n8k16" in text
    setup = (moe_mma.SOURCE.parents[2] / "setup.py").read_text()
    assert '"megatron_trace.kernels": ["*.cu"]' in setup  # (installed packages carry the source)


def test_token_tile_fits_two_ctas_per_multiprocessor():
    assert moe_mma.token_tile(2048) == 16 and moe_mma.token_tile(3584) == 16
    assert moe_mma.token_tile(3840) == 8 and moe_mma.token_tile(7168) == 8
    assert moe_mma.token_tile(8192) == 0
    # the balanced split's few words next to the token rows never cost token rows
    for k in range(256, 7169, 256):
        tt = moe_mma.token_tile(k)
        assert moe_mma.token_tile(k, balanced=True) == tt
        assert tt * (2 * k + 32) + moe_mma.BALANCED_SMEM <= moe_mma.SMEM_LIMIT
    for k in (2048, 7168):
        assert 2 * (moe_mma.token_tile(k) * (2 * k + 32) + 1024) <= 228 * 1024


def test_preferred_for_decode_sizes():
    """From 32 rows to half a token pass per expert on average: 16-token passes at K = 2048, 8 at K = 7168."""
    w = _weight(e=8, k=2048)
    assert [moe_mma.preferred(r, w) for r in (31, 32, 64, 65)] == [False, True, True, False]
    w = _weight(e=64, k=7168)
    assert [moe_mma.preferred(r, w) for r in (31, 32, 256, 257)] == [False, True, True, False]
    assert not moe_mma.preferred(64, _weight(e=300, k=256))  # (more experts than the balanced split's threads)


def test_preferred_only_with_auto(monkeypatch):
    monkeypatch.setattr(moe_mma, "AUTO", False)
    assert not moe_mma.preferred(64, _weight(e=8, k=2048))


def test_unsupported_on_the_cpu_names_the_device():
    w = _weight()
    assert "cpu" in moe_mma.unsupported(torch.zeros(2, 512), w)
    with pytest.raises(ValueError, match="cannot run this call.*cpu"):
        moe_mma.grouped_mm(torch.zeros(2, 512), w, torch.tensor([1, 1, 2, 2], dtype=torch.int32))


def test_unsupported_where_the_gpu_has_too_little_shared_memory(monkeypatch):
    """sm_120 (RTX 50xx, GB10) opts in to 99 KiB per block, the kernel takes SMEM_LIMIT: auto must not pick it.
    (The device queries are stand-ins: no GPU here.)"""
    import types

    monkeypatch.setattr(moe_mma, "_capability", lambda index: (12, 0))
    weight = types.SimpleNamespace(codes=types.SimpleNamespace(device=torch.device("cuda", 0)), fmt="nvfp4",
                                   shape=(4, 64, 512))
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(moe_mma, "_shared_memory_optin", lambda index: 101376)
    assert "101376 bytes of shared memory per block" in moe_mma.unsupported(None, weight)
    monkeypatch.setattr(moe_mma, "_shared_memory_optin", lambda index: 232448)  # an H200
    assert moe_mma.unsupported(None, weight) is None


def test_fp4_grouped_mm_names_a_bad_gemm_and_runs_the_reference_on_the_cpu():
    w = _weight()
    x = torch.randn(4, 512).to(torch.bfloat16)
    offs = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="gemm='cutlass' is not one of"):
        fp4_grouped_mm(x, w, offs, gemm="cutlass")
    assert torch.equal(fp4_grouped_mm(x, w, offs, gemm="mma"), grouped_mm_reference(x, w, offs))


@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
def test_pack_puts_each_byte_where_the_kernel_loads_it(fmt, per_row):
    """Packed byte at 4096 blk + 512 (4 t + 2 h + half) + 16 (4 g + q) + b, blk = tile x steps + step, is byte 128
    step + 64 half + 16 q + b of row 32 tile + 16 t + 8 h + g; lane 4 g + q's scales of a step are contiguous in the
    order the kernel's Step holds them. Every position checked against that formula; unpack inverts pack."""
    e, n, k = 2, 64, 768
    w = Quantizer(fmt, per_row=per_row).quantize(torch.randn(e, n, k))
    p = moe_mma.pack(w)
    codes, scales = w.codes.view(torch.uint8), w.block_scales.view(torch.uint8)
    pc, ps = p.codes.view(torch.uint8), p.block_scales.view(torch.uint8)
    steps, mx = k // 256, fmt == "mxfp4"
    assert pc.numel() == codes.numel() and ps.numel() == scales.numel()
    idx = torch.arange(pc.numel())
    b, lane, load, blk = idx % 16, idx // 16 % 32, idx // 512 % 8, idx // 4096
    g, q, t, h, half = lane // 4, lane % 4, load // 4, load // 2 % 2, load % 2
    ex, tile, step = blk // (n // 32 * steps), blk // steps % (n // 32), blk % steps
    row = 32 * tile + 16 * t + 8 * h + g
    assert torch.equal(pc, codes[ex, row, 128 * step + 64 * half + 16 * q + b])
    per_lane = 8 if mx else 16  # scale bytes of one lane per step
    idx = torch.arange(ps.numel())
    sb, lane, blk = idx % per_lane, idx // per_lane % 32, idx // (32 * per_lane)
    g, q, ex, tile, step = lane // 4, lane % 4, blk // (n // 32 * steps), blk // steps % (n // 32), blk % steps
    if mx:  # word (t, h): bytes q and 4 + q of the step's 8
        t, h, half, col = sb // 4, sb // 2 % 2, sb % 2, 8 * step + 4 * (sb % 2) + q
    else:   # word (t, h): bytes 2 q, 2 q + 1, 8 + 2 q, 9 + 2 q of the step's 16
        t, h, half = sb // 8, sb // 4 % 2, sb // 2 % 2
        col = 16 * step + 8 * half + 2 * q + sb % 2
    assert torch.equal(ps, scales[ex, 32 * tile + 16 * t + 8 * h + g, col])
    back = moe_mma.unpack(p)
    assert torch.equal(back.codes, w.codes) and back.shape == w.shape and back.fmt == w.fmt
    assert torch.equal(back.block_scales.view(torch.uint8), scales)
    assert back.global_amax is w.global_amax


def test_pack_names_what_it_cannot_pack():
    with pytest.raises(ValueError, match="N=48"):
        moe_mma.pack(Quantizer("nvfp4").quantize(torch.randn(2, 48, 512)))
    with pytest.raises(ValueError, match="K=320"):
        moe_mma.pack(Quantizer("nvfp4").quantize(torch.randn(2, 64, 320)))
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        moe_mma.pack(Quantizer("nvfp4").quantize(torch.randn(64, 512)))


def test_fp4_grouped_mm_on_the_cpu_unpacks_packed_weights():
    w = _weight()
    x = torch.randn(4, 512).to(torch.bfloat16)
    offs = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    ref = grouped_mm_reference(x, w, offs)
    assert torch.equal(fp4_grouped_mm(x, moe_mma.pack(w), offs), ref)
    assert torch.equal(fp4_grouped_mm(x, w, offs, packed=moe_mma.pack(w)), ref)


def test_defines_must_name_a_macro_the_source_reads():
    """``DEFINES``: a macro the source does not read (``MIN_BLOCK=1``) built the default kernel, timed and reported
    under that variant's name; refused by the build now (CPU: the check comes before any compile)."""
    from megatron_trace.kernels import moe_wgmma

    src = moe_mma.SOURCE.read_text()
    moe_mma.check_defines(("MIN_BLOCKS=1", "SKIP_DEQUANT=1", "PROBE_CONTIGUOUS"), src)
    with pytest.raises(ValueError, match=r"\['MIN_BLOCK=1'\].*one of \['MIN_BLOCKS', 'SKIP_DEQUANT', 'PROBE_CONT"):
        moe_mma.check_defines(("SKIP_DEQUANT=1", "MIN_BLOCK=1"), src)
    with pytest.raises(ValueError, match="XS=5"):  # a wgmma macro is not the mma kernel's
        moe_mma._kernel.__wrapped__(0, False, False, True, 8, ("XS=5",))
    with pytest.raises(ValueError, match="STAGES=5"):
        moe_wgmma._kernel.__wrapped__(0, False, 128, 32, ("XS=5", "STAGES=5"))
