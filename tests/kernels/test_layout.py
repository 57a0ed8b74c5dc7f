"""The Triton dequantize and record compaction refuse FP4 tensors whose parts do not fit their shape and format
(they read the parts through raw pointers: a short codes tensor was read out of bounds, int8 codes or E8M0 scales
in an NVFP4 tensor were decoded as other values than the reference's, silently)."""

import dataclasses

import pytest
import torch

from megatron_trace.formats import Quantizer
from megatron_trace.kernels.layout import check_fp4

from ._gpu import DEVICE, needs_triton, same_bits

if DEVICE is not None:
    from megatron_trace.kernels import dequant_triton


def _t(fmt: str):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    return Quantizer(fmt, per_row=fmt == "nvfp4").quantize(x.to(DEVICE or "cpu"))


def _bad(fmt: str) -> dict:
    t = _t(fmt)
    other = torch.float8_e8m0fnu if fmt == "nvfp4" else torch.float8_e4m3fn
    cases = {
        "codes_int8": (t.codes.view(torch.int8), "codes must be torch.uint8", "codes"),
        "scales_u8": (t.block_scales.view(torch.uint8), "block_scales must be", "block_scales"),
        "scales_other_format": (t.block_scales.view(other), "block_scales must be", "block_scales"),
        "codes_short": (t.codes[:, :16], r"codes has shape \(3, 16\), expected \(3, 32\)", "codes"),
        "scales_short": (t.block_scales[:, :1], r"block_scales has shape \(3, 1\)", "block_scales"),
    }
    bad = {name: (dataclasses.replace(t, **{field: v}), match) for name, (v, match, field) in cases.items()}
    bad["shape_wider"] = (dataclasses.replace(t, shape=(3, 96)), r"expected \(3, 48\) for shape \(3, 96\)")
    if fmt == "nvfp4":
        bad["amax_missing"] = (dataclasses.replace(t, global_amax=None), "global_amax must be a float tensor")
        bad["amax_flat"] = (dataclasses.replace(t, global_amax=t.global_amax.reshape(3)), r"expected \[\]")
    else:
        bad["amax_given"] = (dataclasses.replace(t, global_amax=torch.ones(())), "must be None for fmt='mxfp4'")
    return bad


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_and_compact_name_a_part_that_does_not_fit(fmt):
    for t, match in _bad(fmt).values():
        with pytest.raises((TypeError, ValueError), match=match):
            dequant_triton.dequantize(t, torch.bfloat16)
        with pytest.raises((TypeError, ValueError), match=match):
            dequant_triton.compact(t)
    t = _t(fmt)  # the well-formed tensor still runs, with the reference's bits
    assert same_bits(dequant_triton.dequantize(t, torch.bfloat16), t.dequantize(torch.bfloat16))


def test_check_fp4_accepts_views_and_records():
    t = Quantizer("nvfp4", per_row=True).quantize(torch.randn(4, 2, 40))
    rows = dataclasses.replace(t, codes=t.codes[1:3], block_scales=t.block_scales[1:3], global_amax=t.global_amax[1:3],
                               shape=(2, 2, 40))
    check_fp4(rows)
    check_fp4(t.guidance(compact=False), "record")
    check_fp4(dataclasses.replace(t, global_amax=t.global_amax.amax()))  # per tensor
    with pytest.raises(TypeError, match="must be an FP4Tensor or FullGuidance, got CompactGuidance"):
        check_fp4(t.guidance(compact=True))


@pytest.mark.parametrize("case", ["no_dims", "int_amax", "scales_elsewhere", "amax_elsewhere"])
def test_check_fp4_names_a_shape_dtype_or_device_that_does_not_fit(case):
    t = Quantizer("nvfp4", per_row=True).quantize(torch.randn(4, 40))
    bad, err, match = {
        "no_dims": (dict(shape=()), ValueError, r"t.shape must have at least one dim, got \(\)"),
        "int_amax": (dict(global_amax=t.global_amax.to(torch.int32)), TypeError,
                     "global_amax must be a float tensor for fmt='nvfp4', got torch.int32"),
        "scales_elsewhere": (dict(block_scales=t.block_scales.to("meta")), ValueError,
                             "block_scales is on meta, its codes on cpu: one device"),
        "amax_elsewhere": (dict(global_amax=t.global_amax.to("meta")), ValueError,
                           "global_amax is on meta, its codes on cpu: one device"),
    }[case]
    with pytest.raises(err, match=match):
        check_fp4(dataclasses.replace(t, **bad))
