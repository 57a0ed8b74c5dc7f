"""FP4-weight grouped GEMM for MoE decode (W4A16, and W4A4 emulation): dispatch and torch reference.

Layout (what ``formats`` produces for a stacked expert weight [E, N, K]): packed codes [E, N, K/2],
block scales [E, N, K/B] along K, NVFP4 global amax [] (per tensor) or [E, N, 1] (per row).
Tokens are grouped by expert like ``torch._grouped_mm``'s ``offs``: rows ``offs[e-1]:offs[e]`` of x
(``offs[-1] = 0``) use expert e; rows past ``offs[-1]`` get zeros. ``y = x_e @ W_e^T`` in fp32, cast once.
"""

from __future__ import annotations

import torch

from ..formats.tensor import FP4Tensor, check_float_dtype
from .dispatch import Kernel, select_kernel
from .layout import check_fp4


def check_grouped_args(x, weight: FP4Tensor, offs: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes/dtypes of a grouped FP4 GEMM; returns (E, N, K)."""
    if not isinstance(weight, FP4Tensor) and type(weight).__name__ != "PackedWeight":
        raise TypeError(f"weight must be an FP4Tensor of shape [E, N, K] (or moe_mma.PackedWeight), got "
                        f"{type(weight).__name__}")
    if len(weight.shape) != 3:
        raise ValueError(f"weight.shape={tuple(weight.shape)} must be [experts, N, K]")
    if isinstance(weight, FP4Tensor):
        check_fp4(weight, "weight")  # (the Triton kernel reads codes and scales with the sizes of weight.shape)
    e, n, k = weight.shape
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be an int32/int64 tensor [{e}] (cumulative tokens per expert), got "
                        f"{type(offs).__name__}")
    xk = x.shape[-1]
    if x.dim() != 2 or xk != k:
        raise ValueError(f"x.shape={tuple(x.shape)} must be [tokens, {k}] for weight.shape={tuple(weight.shape)}")
    if k % weight.block_size:
        raise ValueError(f"K={k} must be a multiple of the {weight.fmt} block size {weight.block_size}")
    g = weight.global_amax
    if g is not None and g.dim() and tuple(g.shape) != (e, n, 1):
        raise ValueError(f"weight.global_amax shape {tuple(g.shape)} must be [] or {(e, n, 1)}")
    if offs.dim() != 1 or offs.numel() != e or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs must be int32/int64 of shape [{e}] (cumulative tokens per expert), got "
                         f"{offs.dtype} {tuple(offs.shape)}")
    return e, n, k


def result_dtype(x, out_dtype) -> torch.dtype:
    """The grouped GEMM's output dtype: ``out_dtype`` (a float dtype: an int one truncated the products), else bf16
    for FP4 activations and x's dtype otherwise; x must be an FP4Tensor or a float tensor (an int x gave an int
    result, truncated)."""
    if not isinstance(x, FP4Tensor) and not (isinstance(x, torch.Tensor) and x.dtype.is_floating_point):
        raise TypeError(f"x must be a float tensor [tokens, K] or an FP4Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if out_dtype is not None:
        return check_float_dtype(out_dtype, "out_dtype")
    return torch.bfloat16 if isinstance(x, FP4Tensor) else x.dtype


def _dense_x(x) -> torch.Tensor:
    """Activations as a float tensor: W4A4 emulation dequantizes FP4 activations first."""
    return x.dequantize(torch.float32) if isinstance(x, FP4Tensor) else x


def gpu_activations(x) -> torch.Tensor:
    """The GPU GEMMs' activations: bf16 with unit stride along K (their MMAs run bf16 x bf16 -> fp32); FP4
    activations (W4A4 emulation) dequantized to bf16 first by the Triton dequantize."""
    if isinstance(x, FP4Tensor):
        from .dequant_triton import dequantize

        x = dequantize(x, torch.bfloat16)
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    return x if x.stride(-1) == 1 else x.contiguous()


def grouped_mm_reference(x, weight: FP4Tensor, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None):
    """Dequantize the weights, then per expert ``x_e.float() @ W_e.float().T``; cast to ``out_dtype``.

    ``x``: [T, K] float tensor (W4A16) or an FP4Tensor of shape [T, K] (W4A4 emulation).
    ``out_dtype`` defaults to bf16 for FP4 activations and to x.dtype otherwise.
    """
    out_dtype = result_dtype(x, out_dtype)
    xd = _dense_x(x)
    e, n, k = check_grouped_args(xd, weight, offs)
    w = weight.dequantize(torch.float32)  # [E, N, K]
    y = torch.zeros(xd.shape[0], n, dtype=torch.float32, device=xd.device)
    start = 0
    for ex, end in enumerate(offs.tolist()):
        if end < start or end > xd.shape[0]:
            raise ValueError(f"offs must be non-decreasing and <= tokens={xd.shape[0]}, got {offs.tolist()}")
        y[start:end] = xd[start:end].float() @ w[ex].T
        start = end
    return y.to(out_dtype)


GEMMS = ("auto", "mma", "wgmma", "triton")


def fp4_grouped_mm(x, weight, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                   kernel: str | Kernel = "auto", gemm: str = "auto", packed=None) -> torch.Tensor:
    """Grouped ``x_e @ W_e^T`` with FP4 expert weights (see the module docstring for the layout).

    ``x``: bf16/fp16 [T, K] (W4A16) or an FP4Tensor [T, K] (W4A4 emulation: dequantized to bf16 first).
    ``weight``: an FP4Tensor [E, N, K], or the same in ``moe_mma.pack``'s or ``moe_wgmma.pack``'s layout (a
    ``moe_mma.PackedWeight``: only the CUDA kernels read it; elsewhere it is unpacked first). ``packed``: optionally,
    ``weight`` packed too, for the CUDA kernel of its layout where it runs.
    The GPU paths dequantize the weights in registers; results match the reference within bf16/accumulation-order
    tolerance (not bit for bit). ``gemm`` picks the GPU kernel: ``"mma"`` the CUDA decode kernel (``moe_mma``),
    ``"wgmma"`` the CUDA prefill kernel (``moe_wgmma``; both: an error names why where it cannot run), ``"triton"``
    the Triton kernel, ``"auto"`` the Triton kernel unless the packed weights of a CUDA kernel are given, its ``AUTO``
    is on and its ``preferred`` holds (mma weights given as ``weight`` itself, not ``packed=``, take the mma kernel
    wherever its ``unsupported`` is None: there is no FP4Tensor to hand the Triton kernel without unpacking).
    """
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
    from . import moe_mma

    if isinstance(weight, moe_mma.PackedWeight):
        packed, weight = weight, None
    elif not isinstance(weight, FP4Tensor):  # (was: AttributeError 'codes')
        raise TypeError(f"weight must be an FP4Tensor of shape [E, N, K] (or moe_mma.PackedWeight), got "
                        f"{type(weight).__name__}")
    result_dtype(x, out_dtype)
    if gemm == "wgmma" and (packed is None or packed.layout != "wgmma"):
        raise ValueError("gemm='wgmma' needs the weights in moe_wgmma.pack's layout (weight= or packed=)")
    dev = (packed if weight is None else weight).codes.device
    if select_kernel(kernel, dev) is Kernel.REFERENCE:
        return grouped_mm_reference(x, moe_mma.unpack(packed) if weight is None else weight, offs, out_dtype=out_dtype)
    y = _gpu_grouped_mm(x, weight, offs, out_dtype, gemm, packed)
    want = result_dtype(x, out_dtype)  # the reference's dtype
    return y if y.dtype == want else y.to(want)  # (the GPU kernels write bf16 unless asked otherwise)


def _gpu_grouped_mm(x, weight, offs, out_dtype, gemm, packed) -> torch.Tensor:
    from . import moe_mma

    if packed is not None and packed.layout == "wgmma":
        from . import moe_wgmma

        if gemm == "wgmma" or (gemm == "auto" and moe_wgmma.unsupported(x, packed, out_dtype) is None
                               and moe_wgmma.preferred(x.shape[0], packed)):
            return moe_wgmma.grouped_mm(x, packed, offs, out_dtype=out_dtype)
        weight, packed = (moe_wgmma.unpack(packed) if weight is None else weight), None
    if packed is not None:
        if gemm == "mma" or (gemm == "auto" and moe_mma.unsupported(x, packed, out_dtype) is None
                             and (weight is None or moe_mma.preferred(x.shape[0], packed))):
            return moe_mma.grouped_mm(x, packed, offs, out_dtype=out_dtype)  # (gemm="mma" raises where it cannot run)
        if weight is None:
            weight = moe_mma.unpack(packed)
    if gemm == "mma":
        return moe_mma.grouped_mm(x, weight, offs, out_dtype=out_dtype)
    from . import moe_triton  # (imports triton)

    return moe_triton.grouped_mm(x, weight, offs, out_dtype=out_dtype)
