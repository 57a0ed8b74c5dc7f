"""The Triton FP4-weight grouped GEMM (CUDA) matches dequantize-then-matmul within bf16 tolerance."""

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels import fp4_grouped_mm, grouped_mm_reference

from ._gpu import needs_cuda

pytestmark = needs_cuda

if torch.cuda.is_available():
    from megatron_trace.kernels import moe_triton


def _case(fmt, per_row, e, n, k, tokens_per_expert, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wq = Quantizer(fmt, per_row=per_row).quantize((torch.randn(e, n, k, generator=gen) * 0.02).cuda())
    tpe = torch.tensor(tokens_per_expert)
    offs = tpe.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(int(tpe.sum()) + 3, k, generator=gen).to(torch.bfloat16).cuda()
    return x, wq, offs


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


CONFIGS = [c[1] for c in moe_triton.CONFIGS] if torch.cuda.is_available() else []


@pytest.mark.parametrize("deq_asm", [True, False], ids=["ptx", "triton"])
@pytest.mark.parametrize("fmt,per_row", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_matches_reference(fmt, per_row, config, deq_asm):
    x, wq, offs = _case(fmt, per_row, 5, 192, 512, [1, 0, 17, 3, 40])
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    y = moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=config, deq_asm=deq_asm)
    assert _rel(y, ref) < 2e-3, _rel(y, ref)
    assert torch.equal(y[-3:], torch.zeros_like(y[-3:]))


def test_uneven_k_and_n_and_w4a4():
    x, wq, offs = _case("nvfp4", False, 3, 100, 80, [2, 5, 1], seed=1)
    ref = grouped_mm_reference(x, wq, offs)
    assert _rel(fp4_grouped_mm(x, wq, offs, kernel="triton"), ref) < 1e-2
    xq = Quantizer("nvfp4", per_row=True).quantize(x)
    ref4 = grouped_mm_reference(xq, wq, offs, out_dtype=torch.float32)
    assert _rel(fp4_grouped_mm(xq, wq, offs, kernel="triton", out_dtype=torch.float32), ref4) < 1e-2


def test_decode_shape_qwen3_fc1_one_token_per_expert():
    x, wq, offs = _case("nvfp4", False, 128, 1536, 2048, [1] * 128, seed=2)
    ref = grouped_mm_reference(x, wq, offs, out_dtype=torch.float32)
    assert _rel(fp4_grouped_mm(x, wq, offs, out_dtype=torch.float32), ref) < 2e-3
