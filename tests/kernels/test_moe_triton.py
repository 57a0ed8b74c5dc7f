"""The Triton FP4-weight grouped GEMM matches dequantize-then-matmul within bf16 tolerance.

CUDA: every ``CONFIGS`` row, both dequant paths. Triton's CPU interpreter (``TRITON_INTERPRET=1``): small
shapes, Triton-ops dequant (the interpreter cannot run inline PTX). The PTX dequant's integer/bf16x2
arithmetic is checked everywhere by executing its instruction text on the CPU.
"""

import re

import pytest
import torch

from megatron_trace.formats import Quantizer, e2m1
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference

from ._gpu import DEVICE, HAS_TRITON, bits, needs_cuda, needs_triton

if DEVICE is not None:
    from megatron_trace.kernels import moe_triton


def _case(fmt, per_row, e, n, k, tokens_per_expert, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    wq = Quantizer(fmt, per_row=per_row).quantize((torch.randn(e, n, k, generator=gen) * 0.02).to(device))
    tpe = torch.tensor(tokens_per_expert)
    offs = tpe.cumsum(0).to(torch.int32).to(device)
    x = torch.randn(int(tpe.sum()) + 3, k, generator=gen).to(torch.bfloat16).to(device)
    return x, wq, offs


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


# every CONFIGS row, and decode candidates with a register cap (7th element)
CONFIGS = ([c[1] for c in moe_triton.CONFIGS] + [(128, 128, 16, 4, 4, 0, 96), (256, 128, 16, 8, 2, 0, 80)]
           if DEVICE == "cuda" else [])


@needs_cuda
@pytest.mark.parametrize("deq_asm", [True, False], ids=["ptx", "triton"])
@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("n", [192, 256], ids=["n192", "n256"])  # N % BN != 0 (row masks) and == 0 (none)
def test_matches_reference(fmt, per_row, config, deq_asm, n):
    x, wq, offs = _case(fmt, per_row, 5, n, 512, [1, 0, 17, 3, 40])
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=deq_asm)
    assert _rel(y, ref) < 2e-3, _rel(y, ref)
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))


@needs_cuda
@pytest.mark.parametrize("shape", [(5, 192, 512, [1, 0, 17, 3, 40]), (16, 384, 1024, [61, 0, 300, 7] * 4)],
                         ids=["n192", "n384"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_repeated_launches_give_identical_bits(config, shape):
    """No races: the kernel has no atomics, so every launch on the same inputs writes the same bits, and the
    reference (dequantize, then matmul) is as deterministic (one run of ``test_matches_reference`` in about
    twenty gave a 3% error at n192)."""
    x, wq, offs = _case("nvfp4", True, *shape, seed=3)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    first = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=False)
    assert _rel(first, ref) < 2e-3
    bad = sum(not torch.equal(moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config,
                                                    deq_asm=False), first) for _ in range(40))
    bad_ref = sum(not torch.equal(grouped_mm_reference(x, wq, offs, out_dtype=torch.float32), ref) for _ in range(10))
    assert (bad, bad_ref) == (0, 0), f"{bad} of 40 launches / {bad_ref} of 10 references differ from the first"


@needs_cuda
def test_uneven_k_and_n_and_w4a4():
    x, wq, offs = _case("nvfp4", False, 3, 100, 80, [2, 5, 1], seed=1)
    ref = grouped_mm_reference(x, wq, offs)
    assert _rel(fp4_grouped_mm(x, wq, offs, kernel="triton", gemm="triton"), ref) < 1e-2
    xq = Quantizer("nvfp4", per_row=True).quantize(x)
    ref4 = grouped_mm_reference(xq, wq, offs, out_dtype=torch.float32)
    assert _rel(fp4_grouped_mm(xq, wq, offs, kernel="triton", gemm="triton", out_dtype=torch.float32), ref4) < 1e-2


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_the_result_has_the_references_dtype(dtype):
    """fp16 / fp32 activations: every GPU path (bf16 MMAs inside) returns the reference's dtype (x's)."""
    x, wq, offs = _case("nvfp4", False, 3, 64, 128, [2, 5, 1], seed=3)
    x = x.to(dtype)
    ref = grouped_mm_reference(x, wq, offs)
    for gemm in ("triton", "auto"):
        y = fp4_grouped_mm(x, wq, offs, gemm=gemm)
        assert y.dtype == ref.dtype == dtype and _rel(y, ref) < 1e-2, gemm


@needs_cuda
def test_decode_shape_qwen3_fc1_one_token_per_expert():
    x, wq, offs = _case("nvfp4", False, 128, 1536, 2048, [1] * 128, seed=2)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(fp4_grouped_mm(x, wq, offs, out_dtype=torch.float32, gemm="triton"), ref) < 2e-3


@needs_triton
@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("config,shape", [
    ((32, 128, 16, 4, 1), (3, 64, 256, [1, 0, 17])),  # two token tiles for expert 2, an empty expert
    ((32, 128, 16, 4, 1, 0, 96), (3, 48, 256, [1, 0, 17])),  # a register cap (a compile option: none here)
    ((16, 64, 16, 4, 1), (3, 40, 96, [2, 5, 1])),  # N and K not multiples of the tile
    ((32, 128, 16, 4, 1, True), (3, 64, 256, [1, 0, 17])),  # join_k: one MMA over K-ordered weights
    ((16, 64, 32, 4, 1, True), (3, 40, 96, [2, 5, 1])),
], ids=["even", "capped_uneven_n", "uneven", "join_k", "join_k_uneven"])
def test_triton_path_small(fmt, per_row, config, shape):
    x, wq, offs = _case(fmt, per_row, *shape, device=DEVICE)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=False)
    assert _rel(y, ref) < 1e-5, _rel(y, ref)  # exact products, fp32 sums in another order
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))  # rows past offs[-1], written by the kernel


@needs_triton
@pytest.mark.parametrize("per_row", [False, True], ids=["tensor", "row"])
def test_triton_path_saturated_encode_scale(per_row):
    """Weights whose global amax lies below 2688 / FLT_MAX (S_enc saturates at FLT_MAX): the kernel's column scale
    2**62 / S_enc comes from the saturated S_enc, and its outputs are the reference's (nonzero: before the
    saturation S_enc was inf and both gave zeros)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 64, 256, generator=gen) * 1e-38
    x = torch.randn(21, 256, generator=gen).to(torch.bfloat16)
    offs = torch.tensor([1, 1, 18], dtype=torch.int32)
    wq = Quantizer("nvfp4", per_row=per_row).quantize(w)
    assert float(wq.global_amax.max()) < 7.9e-36
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert ref[:18].abs().amax(-1).min() > 0  # not flushed: every token's row has nonzero outputs
    y = moe_triton.grouped_mm(x.to(DEVICE), Quantizer("nvfp4", per_row=per_row).quantize(w.to(DEVICE)),
                              offs.to(DEVICE), out_dtype=torch.float32, config=(32, 128, 16, 4, 1), deq_asm=False)
    assert _rel(y.cpu() * 2.0**100, ref * 2.0**100) < 1e-5  # scaled exactly: the norm's squares do not underflow


@needs_triton
@pytest.mark.parametrize("config", [(32, 128, 16, 4, 1), (16, 64, 32, 4, 1, True)], ids=["split_k", "join_k"])
def test_int64_token_offsets_give_the_int32_paths_bits(config, monkeypatch):
    """``WIDE`` (int64 row offsets, for x or y past 2**31 elements) forced at a small shape: the same bits."""
    x, wq, offs = _case("nvfp4", True, 3, 64, 256, [1, 0, 17], device=DEVICE)
    narrow = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=False)
    monkeypatch.setattr(moe_triton, "WIDE_ELEMENTS", 0)
    assert moe_triton.launch_spec(20, wq, config, False, 256, 64)[2]["WIDE"]
    wide = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=False)
    if DEVICE == "cuda" and len(config) > 5:
        # sm_90 (H200, session 15): the join_k build with int64 rows is deterministic but sums in another order than
        # the int32 one (1 ulp apart, 1.2e-7); the decode path (4 MMAs of BK/4) gives the same bits
        assert _rel(wide, narrow) < 1e-6
    else:
        assert torch.equal(wide, narrow)


@needs_cuda
def test_rows_past_2_31_elements():
    """x of more than 2**31 elements (a long prefill's routed rows, K = 2048): the rows at the end are right (they
    read out of bounds with int32 offsets: an illegal memory access on the H200, session 14)."""
    k, n = 2048, 128
    t = 2**31 // k + 1000
    gen = torch.Generator(device="cuda").manual_seed(5)
    wq = Quantizer("nvfp4", per_row=True).quantize(torch.randn(2, n, k, generator=gen, device="cuda") * 0.02)
    x = torch.randn(t, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([t // 2, t], dtype=torch.int32, device="cuda")
    y = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32)
    w = wq.dequantize(torch.bfloat16).float()
    for rows, e in ((slice(0, 64), 0), (slice(t - 64, t), 1)):
        assert _rel(y[rows], x[rows].float() @ w[e].T) < 2e-3


@needs_triton
def test_bad_config_is_named():
    x, wq, offs = _case("nvfp4", False, 2, 32, 64, [1, 1], device=DEVICE)
    with pytest.raises(ValueError, match="BK=48"):
        moe_triton.grouped_mm(x, wq, offs, config=(32, 48, 16, 4, 1))
    with pytest.raises(ValueError, match="max_registers=300"):
        moe_triton.grouped_mm(x, wq, offs, config=(32, 64, 16, 4, 1, 0, 300))


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Execute the PTX subset of ``_DEQ_PTX`` (shr/and/mul.lo on b32, mul.rn.bf16x2) on Python ints."""
    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    def bf16x2_mul(a, b):
        pair = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16)
        h = pair.view(torch.bfloat16)
        p = (h[:2] * h[2:]).view(torch.int16).to(torch.int32) & 0xFFFF  # fp32 product rounded to bf16 (RNE)
        return int(p[0]) | int(p[1]) << 16

    for ins in text.strip("{} ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, a, b = [t.strip() for t in args.split(",")]
        if op == "shr.b32":
            regs[d] = val(a) >> val(b)
        elif op == "and.b32":
            regs[d] = val(a) & val(b)
        elif op == "mul.lo.u32":
            regs[d] = (val(a) * val(b)) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            regs[d] = bf16x2_mul(val(a), val(b))
        else:
            raise AssertionError(f"unexpected PTX op {op}")
    return regs


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (for the PTX text)")
def test_ptx_dequant_arithmetic():
    """Out $q = code q of each uint16 group, value * 2**-126 * scale, for every code and scale 2**64 * 2**j."""
    from megatron_trace.kernels.moe_triton import _DEQ_PTX

    text = _DEQ_PTX.value if hasattr(_DEQ_PTX, "value") else str(_DEQ_PTX)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 8), generator=gen, dtype=torch.uint8)
    codes[:16, 0] = torch.arange(16, dtype=torch.uint8)  # every code in every position of the word
    codes[:16, 5] = torch.arange(16, dtype=torch.uint8)
    words = e2m1.pack(codes).view(torch.int32)  # [64, 1]: groups g0 (codes 0..3) low, g1 (codes 4..7) high
    scales = torch.tensor([2.0 ** 64, 448 * 2.0 ** 64, 2.0 ** -9 * 2.0 ** 64], dtype=torch.bfloat16)
    for si, sv in enumerate(scales):
        sbits = int(sv.view(torch.int16)) & 0xFFFF
        for row in range(codes.shape[0]):
            w = int(words[row, 0]) & 0xFFFFFFFF
            out = _run_ptx(re.sub(r"\$(\d)", r"R\1", text), {"R4": w, "R5": sbits | sbits << 16})
            got = torch.tensor([[out[f"R{q}"] & 0xFFFF, out[f"R{q}"] >> 16] for q in range(4)], dtype=torch.int32)
            got = got.to(torch.int16).view(torch.bfloat16).double().T.reshape(-1)  # [g0 q0..q3, g1 q0..q3]
            want = e2m1.decode(codes[row], torch.float64) * 2.0 ** -126 * float(sv)
            assert torch.equal(got, want), (si, row, got, want)


@needs_triton
@pytest.mark.parametrize("experts, batch", [(32, 8), (32, 32), (32, 64), (32, 128), (128, 16), (128, 128),
                                            (128, 256)])
def test_default_token_tile_holds_the_busiest_expert(experts, batch):
    """Under uniform random top-8 routing the default config's token tile holds the busiest expert's tokens in most
    draws (one pass over its weights), and a tile of half its size would not (not twice too large)."""
    gen = torch.Generator().manual_seed(experts + batch)
    busiest = torch.tensor([
        torch.bincount(torch.rand(batch, experts, generator=gen).topk(8, dim=1).indices.flatten(),
                       minlength=experts).max().item() for _ in range(200)])
    bt = moe_triton.default_config(batch * 8, experts, 2048)[0][2]
    assert (busiest <= bt).float().mean() >= 0.5, (bt, busiest.float().mean())
    if bt > 16:
        assert (busiest <= bt // 2).float().mean() < 0.5, (bt, busiest.float().mean())


@needs_triton
@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("config,shape,k_slices", [
    ((32, 64, 16, 4, 1), (3, 64, 256, [1, 0, 17]), 2),  # two token tiles for expert 2, an empty expert
    ((32, 64, 16, 4, 1), (3, 64, 256, [1, 0, 17]), 4),  # one K tile per slice
    ((16, 64, 16, 4, 1), (3, 40, 192, [2, 5, 1]), 3),  # N not a multiple of the tile, 3 slices
    ((32, 64, 16, 4, 1, True), (3, 64, 256, [1, 0, 17]), 2),  # join_k
], ids=["s2", "s4", "s3_uneven_n", "join_k_s2"])
def test_k_slices_match_the_reference(fmt, per_row, config, shape, k_slices):
    """K split over programs, partials summed in slice order: the reference's products, rows past offs[-1] zero."""
    x, wq, offs = _case(fmt, per_row, *shape, device=DEVICE)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=False, k_slices=k_slices)
    assert _rel(y, ref) < 1e-5, _rel(y, ref)
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))


@needs_triton
def test_k_slices_bad_count_and_wide_rows_are_named():
    x, wq, offs = _case("nvfp4", False, 2, 32, 256, [1, 1], device=DEVICE)
    with pytest.raises(ValueError, match=r"k_slices=3 must divide the 4 K tiles of the config: one of \[1, 2, 4\]"):
        moe_triton.grouped_mm(x, wq, offs, config=(32, 64, 16, 4, 1), k_slices=3)
    with pytest.raises(ValueError, match="k_slices=2 needs a workspace of fewer than 2..31 elements"):
        moe_triton.launch_spec(2**30, wq, (32, 64, 16, 4, 1), False, 256, 32, k_slices=2)


@needs_cuda
@pytest.mark.parametrize("k_slices", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(128, 1536, 2048, [1] * 8 + [0] * 120), (16, 384, 1024, [61, 0, 300, 7] * 4),
                                   (128, 1536, 2048, [3] * 128)], ids=["qwen3_fc1_b1", "n384", "qwen3_fc1_all"])
def test_k_slices_on_cuda_match_and_repeat(shape, k_slices):
    """Sliced on the GPU (PTX dequant, default tiles): within bf16 tolerance of the reference, and every launch the
    same bits (the partials are summed in slice order, no atomics)."""
    x, wq, offs = _case("nvfp4", True, *shape, seed=4)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    first = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, k_slices=k_slices)
    assert _rel(first, ref) < 2e-3, _rel(first, ref)
    assert torch.equal(first[-3:], torch.zeros_like(first[-3:]))
    bad = sum(not torch.equal(moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, k_slices=k_slices), first)
              for _ in range(20))
    assert bad == 0, f"{bad} of 20 launches differ from the first"
    full = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, k_slices=k_slices, programs=0)
    assert torch.equal(bits(full), bits(first))  # the compact grid (default) and the full grid: the same sums


@needs_triton
@pytest.mark.parametrize("k_slices", [1, 2], ids=["k1", "k2"])
@pytest.mark.parametrize("programs", [1, 2, 5, 64])
@pytest.mark.parametrize("config,shape", [
    ((32, 64, 16, 4, 1), (5, 64, 256, [1, 0, 17, 0, 2])),  # empty experts between, two token tiles for expert 2
    ((16, 64, 16, 4, 1), (4, 40, 128, [0, 0, 3, 0])),  # N not a multiple of the tile, one expert with tokens
    ((32, 64, 16, 4, 1, True), (5, 64, 256, [1, 0, 17, 0, 2])),  # join_k
], ids=["even", "uneven_n", "join_k"])
def test_compact_grid_gives_the_full_grids_bits(config, shape, programs, k_slices):
    """``programs`` programs taking the items of the experts with tokens in turn (fewer or more programs than items)
    compute each output as the full grid's program does: the same bits, rows past offs[-1] zero."""
    x, wq, offs = _case("nvfp4", True, *shape, seed=6, device=DEVICE)
    kw = dict(out_dtype=torch.float32, config=config, deq_asm=False, k_slices=k_slices)
    full = moe_triton.grouped_mm(x, wq, offs, programs=0, **kw)
    compact = moe_triton.grouped_mm(x, wq, offs, programs=programs, **kw)
    assert torch.equal(bits(compact), bits(full))
    assert _rel(full, grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)) < 1e-5
    assert torch.equal(compact[-3:], torch.zeros_like(compact[-3:]))


@needs_triton
@pytest.mark.parametrize("offs", [[2, 5, 14], [-2, 3, 8], [-1, -1, 30]], ids=["past_T", "negative", "all_out"])
@pytest.mark.parametrize("k_slices,programs", [(1, 0), (2, 0), (1, 2)], ids=["full", "k_slices", "compact"])
def test_offs_outside_the_rows_are_clamped_not_read_or_written(offs, k_slices, programs):
    """offs is not checked on the device path (that would be a host sync): entries outside [0, T] act as clamped to
    it, so the kernel never reads x or writes y outside their T rows (it did: heap corruption in the interpreter,
    out-of-bounds accesses on the GPU). x is a view between NaN rows: a read past its rows would show as NaN."""
    gen = torch.Generator().manual_seed(7)
    wq = Quantizer("nvfp4", per_row=True).quantize((torch.randn(3, 64, 256, generator=gen) * 0.02).to(DEVICE))
    padded = torch.full((18, 256), float("nan"), dtype=torch.bfloat16)
    padded[4:14] = torch.randn(10, 256, generator=gen).to(torch.bfloat16)
    x = padded.to(DEVICE)[4:14]
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        grouped_mm_reference(x, wq, torch.tensor(offs, dtype=torch.int32, device=DEVICE))
    clamped = torch.tensor(offs, dtype=torch.int32).clamp(0, 10).to(DEVICE)
    want = grouped_mm_reference(x, wq, clamped, out_dtype=torch.float32)
    y = moe_triton.grouped_mm(x, wq, torch.tensor(offs, dtype=torch.int32, device=DEVICE), out_dtype=torch.float32,
                              config=(32, 128, 16, 4, 1), deq_asm=False, k_slices=k_slices, programs=programs)
    assert bool(torch.isfinite(y).all())
    assert _rel(y, want) < 1e-5, _rel(y, want)


@needs_triton
def test_weights_whose_parts_do_not_fit_are_named():
    """The kernel reads the codes and scales with the sizes of weight.shape: short codes were read out of bounds,
    uint8 scales decoded as E4M3 (a 151% error against the reference's integer scales), int8 codes and a missing
    amax ran where the reference raises; now both name the part."""
    import dataclasses

    x, wq, offs = _case("nvfp4", True, 3, 64, 256, [2, 2, 8], device=DEVICE)
    bad = {"codes must be torch.uint8": dict(codes=wq.codes.view(torch.int8)),
           "codes has shape": dict(codes=wq.codes[..., :64]),
           "block_scales must be torch.float8_e4m3fn": dict(block_scales=wq.block_scales.view(torch.uint8)),
           "global_amax must be a float tensor": dict(global_amax=None)}
    for match, parts in bad.items():
        w = dataclasses.replace(wq, **parts)
        for mm in (grouped_mm_reference, moe_triton.grouped_mm):
            with pytest.raises((TypeError, ValueError), match=match):
                mm(x, w, offs)
