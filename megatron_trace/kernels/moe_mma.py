"""CUDA FP4-weight grouped GEMM for MoE decode (W4A16, sm_90+): ``moe_mma.cu``, compiled at first use by NVRTC.

The same contract as ``moe_triton.grouped_mm`` (layout in ``moe``): ``y = x_e @ W_e^T`` in fp32, rows past
``offs[-1]`` zero. It is written for decode, 1-16 tokens per expert, where the Triton kernel streams the weights at
about half the copy bandwidth (its MMA waits). Weights are streamed once per pass of up to 16 tokens (8 where K is
too long for 16 token rows in shared memory); an expert with more tokens takes more passes. On the H200 it streams
them at 0.57-0.64 of the copy bandwidth with every expert busy (session 24), not the 0.8 the issue asks for: without
any dequantization the same pipeline reaches only 0.66-0.70 (a register double buffer at two CTAs per
multiprocessor keeps too few bytes in flight). ``fp4_grouped_mm`` runs it with ``gemm="mma"`` (``AUTO``: not by
default). ``unsupported`` says why a call cannot run here.

Compiled with ``torch.cuda._compile_kernel`` (PyTorch's NVRTC wrapper; a private API, present from torch 2.8): no
build step, no toolkit beyond the NVRTC library PyTorch's CUDA wheels ship with.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..formats.tensor import FP4Tensor
from .dispatch import cdiv, sm_count
from .moe import check_grouped_args, gpu_activations

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe_mma.cu")
ROWS_PER_CTA = 256  # (WARPS * ROWS_PER_WARP in the source)
THREADS = 256
SMEM_LIMIT = 113 * 1024
"""Shared memory for the token rows (token tile x (2 K + 32) bytes) that leaves room for two CTAs per multiprocessor
(the registers allow two): 16 rows up to K = 3600, 8 up to K = 7216."""
OUT_DTYPES = (torch.bfloat16, torch.float32)


def token_tile(k: int) -> int:
    """Token rows per pass for reduction length ``k`` (0: K too long for 8 rows)."""
    for tt in (16, 8):
        if tt * (2 * k + 32) <= SMEM_LIMIT:
            return tt
    return 0


CTAS_PER_SM = 2  # (MIN_BLOCKS in the source: 128 registers per thread)


def row_blocks_per_cta(experts: int, n: int, device) -> int:
    """Blocks of 256 weight rows one CTA streams in sequence: as many as leave about one wave of CTAs when every
    expert has tokens (a CTA's first loads wait on memory with nothing to overlap them; fewer, longer CTAs pay that
    once per wave instead of once per block)."""
    per_expert = max(1, CTAS_PER_SM * sm_count(device) // max(experts, 1))
    return cdiv(cdiv(n, ROWS_PER_CTA), per_expert)


AUTO = False
"""Whether ``fp4_grouped_mm(gemm="auto")`` runs this kernel where ``preferred``. Off: on the H200 (BENCHMARKS.md,
session 24) it beat the Triton kernel on its own with the same tokens on every expert (Qwen3-30B-A3B's FC1: 0.58
against 0.51 of the copy bandwidth, NVFP4; 0.64 against 0.53, MXFP4), but not in the end-to-end decode, where routing
leaves experts empty or busier than one 16-token pass. ``gemm="mma"`` runs it anyway."""
MAX_MEAN_TOKENS = 16


def preferred(rows: int, weight: FP4Tensor) -> bool:
    """Where ``gemm="auto"`` would run this kernel with ``AUTO`` on: decode sizes with every expert likely to have
    tokens (experts <= rows <= MAX_MEAN_TOKENS x experts) and K short enough for 16-token passes. Few active experts
    are the Triton kernel's (its K slices and compact grid); at DeepSeek-V3's K = 7168 (8-token passes) the Triton
    kernel was faster."""
    experts, _, k = weight.shape
    return AUTO and experts <= rows <= MAX_MEAN_TOKENS * experts and token_tile(k) == 16


def unsupported(x, weight: FP4Tensor, out_dtype: torch.dtype | None = None) -> str | None:
    """Why ``grouped_mm`` cannot run this call (None: it can)."""
    dev = weight.codes.device
    if dev.type != "cuda":
        return f"weights are on {dev}, the CUDA kernel needs a GPU"
    cap = torch.cuda.get_device_capability(dev)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} < 9.0 (the dequantization uses bf16x2 multiplies)"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC; torch >= 2.8)"
    if weight.fmt not in ("nvfp4", "mxfp4") or len(weight.shape) != 3:
        return f"weight {weight.fmt} of shape {tuple(weight.shape)}: needs NVFP4 or MXFP4 [E, N, K]"
    _, n, k = weight.shape
    if k % 256 or n % 32:
        return f"K={k} must be a multiple of 256 and N={n} of 32"
    if not token_tile(k):
        return f"K={k} is too long for 8 token rows in {SMEM_LIMIT} bytes of shared memory"
    dt = out_dtype or torch.bfloat16  # (x is converted to bf16 first, as in the Triton kernel)
    if dt not in OUT_DTYPES:
        return f"out_dtype {dt} (supported: bfloat16, float32)"
    return None


DEFINES: tuple[str, ...] = ()
"""Extra ``NAME=value`` macros for the source (``MIN_BLOCKS``, ``SKIP_DEQUANT``, ``PROBE_CONTIGUOUS``: the build
variants ``benchmarks/bench_moe_mma.py`` times; the last two give wrong numbers)."""


@functools.cache
def _kernel(device_index: int, mx: bool, defines: tuple[str, ...] = ()):
    from torch.cuda import _compile_kernel

    with torch.cuda.device(device_index):
        name = f"fp4_w4a16_mma<{int(mx)}>"
        opts = ["-std=c++17", *(f"-D{d}" for d in defines)]
        kern = _compile_kernel(SOURCE.read_text(), name, nvcc_options=opts)
        kern.set_shared_memory_config(SMEM_LIMIT)
    logger.info("compiled %s for cuda:%d", name, device_index)
    return kern


def grouped_mm(x, weight: FP4Tensor, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W4A16 grouped GEMM (``moe`` has the layout): bf16 or fp32 out. ``x`` may be an FP4Tensor (W4A4 emulation:
    dequantized to bf16 first). Raises ``ValueError`` naming the reason where ``unsupported`` is not None."""
    why = unsupported(x, weight, out_dtype)
    if why:
        raise ValueError(f"the CUDA FP4 grouped GEMM cannot run this call: {why}")
    xd = gpu_activations(x)
    e, n, k = check_grouped_args(xd, weight, offs)
    if xd.stride(0) % 8:  # (16-byte loads of each token row)
        xd = xd.contiguous()
    out_dtype = out_dtype or torch.bfloat16
    t = xd.shape[0]
    y = torch.empty(t, n, dtype=out_dtype, device=xd.device)
    if t == 0:
        return y
    offs32 = offs if offs.dtype == torch.int32 else offs.to(torch.int32)
    g = weight.global_amax
    gmode = 0 if g is None else (1 if g.dim() == 0 else 2)
    codes = _aligned(weight.codes.contiguous().view(torch.uint8))
    scales = _aligned(weight.block_scales.contiguous().view(torch.uint8))
    xd = _aligned(xd)
    g_arg = scales if g is None else g.float().contiguous()
    tt = token_tile(k)
    dev = xd.device.index if xd.device.index is not None else torch.cuda.current_device()
    kern = _kernel(dev, weight.fmt == "mxfp4", DEFINES)
    tiles = row_blocks_per_cta(e, n, xd.device)
    args = [xd, codes, scales, g_arg, y, offs32.contiguous(), t, n, k, e, xd.stride(0), y.stride(0), gmode,
            int(out_dtype == torch.float32), tt, tiles]
    kern(grid=(cdiv(n, ROWS_PER_CTA * tiles), e + 1, 1), block=(THREADS, 1, 1), args=args,
         shared_mem=tt * (2 * k + 32),
         stream=torch.cuda.current_stream(xd.device))
    return y


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied where a view's offset leaves its start off the kernel's 16-byte loads."""
    return t if t.data_ptr() % 16 == 0 else t.clone()
