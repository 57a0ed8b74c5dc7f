"""The GPU-only instructions of ``kernels.triton_fp4`` against their portable forms, in one kernel on the GPU.

``prmt`` (PTX byte permute), ``block_amax`` (packed bf16 max of magnitudes) and ``recip_rn`` (MUFU.RCP and a Newton
step) have a hardware form the kernels use on
CUDA and a form by shifts and fp32 max that Triton's CPU interpreter runs; the quantize tests compare the kernels'
outputs with the reference on both, and these compare the two forms directly, bit for bit, on inputs that cover
every selector nibble and the bf16 values that matter for a max (NaN, +-Inf, +-0, subnormals).
"""

from __future__ import annotations

import pytest
import torch

from ._gpu import DEVICE, HAS_CUDA, HAS_TRITON, needs_cuda

if HAS_TRITON:
    import triton
    import triton.language as tl

    from megatron_trace.kernels import triton_fp4 as f

    @triton.jit
    def _prmt_both(a_ptr, b_ptr, s_ptr, hw_ptr, emu_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a, b, s = tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(s_ptr + i)
        tl.store(hw_ptr + i, f.prmt(a, b, s, True).to(tl.int32, bitcast=True))
        tl.store(emu_ptr + i, f.prmt(a, b, s, False).to(tl.int32, bitcast=True))

    @triton.jit
    def _amax_both(w_ptr, hw_ptr, emu_ptr, NB: tl.constexpr, P: tl.constexpr):
        off = tl.arange(0, NB)[None, :, None] * P + tl.arange(0, P)[None, None, :]
        w = tl.load(w_ptr + off).to(tl.uint32, bitcast=True)
        o = tl.arange(0, NB)[None, :]
        tl.store(hw_ptr + o, f.block_amax(w, 0, True))
        tl.store(emu_ptr + o, f.block_amax(w, 0, False))

    @triton.jit
    def _recip_both(x_ptr, hw_ptr, emu_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(hw_ptr + i, f.recip_rn(x, True))
        tl.store(emu_ptr + i, f.recip_rn(x, False))


pytestmark = [needs_cuda, pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="GPU-only instructions")]


def test_prmt_emulation_matches_the_instruction():
    """Random words, every selector nibble (0-15, so every byte and its sign copy) at every byte position."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    a = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    b = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    nib = torch.randint(0, 16, (n, 4), generator=gen)
    nib[:16] = torch.arange(16)[:, None]  # each nibble value at all four positions
    sel = (nib * (16 ** torch.arange(4))).sum(1).to(torch.int32)
    hw, emu = (torch.empty(n, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _prmt_both[(1,)](a.to(DEVICE), b.to(DEVICE), sel.to(DEVICE), hw, emu, N=n)
    assert torch.equal(hw.cpu(), emu.cpu())


def test_packed_bf16_block_amax_matches_fp32_max():
    """Blocks of 8 bf16 pairs drawn from specials (NaN, +-Inf, +-0, subnormals, the largest finite) and random
    values: the same amax bits, and NaN only for an all-NaN block (a max ignores NaN)."""
    gen = torch.Generator().manual_seed(1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3.0e38, -3.0e38,
                             1.0, -448.0], dtype=torch.bfloat16)
    nb, p = 1024, 8
    vals = (torch.randn(nb * p * 2, generator=gen) * 2.0 ** torch.randint(-20, 20, (nb * p * 2,), generator=gen)
            ).to(torch.bfloat16)
    pick = torch.rand(nb * p * 2, generator=gen) < 0.4
    vals[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),), generator=gen)]
    vals[: 2 * p] = float("nan")  # an all-NaN block
    w = vals.view(torch.int32).reshape(1, nb, p)
    hw, emu = (torch.empty(1, nb, dtype=torch.float32, device=DEVICE) for _ in range(2))
    _amax_both[(1,)](w.to(DEVICE), hw, emu, NB=nb, P=p)
    hw, emu = hw.cpu(), emu.cpu()
    assert torch.equal(torch.isnan(hw), torch.isnan(emu)) and bool(torch.isnan(hw[0, 0]))
    both = ~torch.isnan(hw)
    assert torch.equal(hw[both].view(torch.int32), emu[both].view(torch.int32))


def test_recip_matches_the_correctly_rounded_reciprocal():
    """Every positive E4M3 value (the kernels' divisors), both ends of the documented exponent range -124..124 and
    random significands across it: the same bits as IEEE 1 / x computed on the CPU, and as ``tl.div_rn``."""
    gen = torch.Generator().manual_seed(2)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ends = torch.tensor([2.0 ** -124, 2.0 ** 124 * (2 - 2.0 ** -23), 1.0, 1.5, 3.0, 448.0])
    rnd = (1 + torch.rand(4096 - len(e4m3) - len(ends), generator=gen)) * 2.0 ** torch.randint(
        -124, 125, (4096 - len(e4m3) - len(ends),), generator=gen).float()
    x = torch.cat([e4m3, ends, rnd]).float()
    hw, emu = (torch.empty_like(x, device=DEVICE) for _ in range(2))
    _recip_both[(1,)](x.to(DEVICE), hw, emu, N=x.numel())
    want = (1.0 / x.double()).float()  # fp64 then fp32 rounding: innocuous for fp32 operands (53 >= 2 * 24 + 2)
    assert torch.equal(hw.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.equal(emu.cpu().view(torch.int32), want.view(torch.int32))
