"""CUDA FP4-weight grouped GEMM for MoE decode (W4A16, sm_90+): ``moe_mma.cu``, compiled at first use by NVRTC.

The same contract as ``moe_triton.grouped_mm`` (layout in ``moe``): ``y = x_e @ W_e^T`` in fp32, rows past
``offs[-1]`` zero. It is written for decode, 1-16 tokens per expert, where the Triton kernel streams the weights at
about half the copy bandwidth (its MMA waits). Weights are streamed once per pass of up to 16 tokens (8 where K is
too long for 16 token rows in shared memory); an expert with more tokens takes more passes.

It reads the weights as FP4Tensor stores them or, faster, in its own layout (``pack``: every warp load 512 contiguous
bytes). The row blocks of all experts with tokens are dealt to one wave of CTAs in equal shares of work
(``BALANCED``). On the H200 (session 26), with the same tokens on every expert, the packed layout streams Qwen3's FC1
at 0.70-0.73 of the copy bandwidth at 1-4 tokens per expert (3.5-4.1x bf16 ``torch._grouped_mm``); without
dequantizing, the same pipeline reaches 0.73-0.84, so the dequantization's instructions are what is left. Under
random top-8 routing it takes 0.71-0.84x the Triton kernel's time at 4-128 tokens per batch on that FC1, 0.68-0.77x
on DeepSeek-V3's.
``fp4_grouped_mm`` runs it with ``gemm="mma"``, or with ``gemm="auto"`` where ``AUTO`` is on, the caller passes the
packed weights and ``preferred`` holds. ``unsupported`` says why a call cannot run here.

Compiled with ``torch.cuda._compile_kernel`` (PyTorch's NVRTC wrapper; a private API, present from torch 2.8): no
build step, no toolkit beyond the NVRTC library PyTorch's CUDA wheels ship with. Launched by ``cuda_launch`` (torch's
launcher costs about 50 us of host per call).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from pathlib import Path

import torch

from ..formats.registry import get_format
from ..formats.tensor import FP4Tensor
from . import cuda_launch
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


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """An [E, N, K] FP4 weight's codes and block scales in the kernel's packed layout (``pack``): each warp's 32 rows
    x 256 k of one step are one contiguous 4 KB of codes, and their scales one contiguous 512 (NVFP4) or 256 (MXFP4)
    bytes, so that every load of a warp reads 512 contiguous bytes. The same bytes as the FP4Tensor, permuted."""

    fmt: str
    shape: tuple[int, int, int]
    codes: torch.Tensor  # flat, the FP4Tensor's dtype
    block_scales: torch.Tensor  # flat, the FP4Tensor's dtype
    global_amax: torch.Tensor | None
    layout: str = "mma"
    """"mma": ``pack``'s (this module's kernel); "wgmma": ``moe_wgmma.pack``'s (the large-token kernel)."""

    @property
    def block_size(self) -> int:
        return get_format(self.fmt).block_size


def _pack_views(e: int, n: int, k: int, mx: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(codes view, scales view, scales permutation) of the plain layout; the codes permutation is ``CODES_ORDER``.
    Codes [e, n/32, t, h, g, step, half, q, 16 bytes]: row 16 t + 8 h + g of the warp's 32, byte 128 step + 64 half +
    16 q + b of the row (what lane 4 g + q loads for (t, h, half)). Scales: byte 8 half + 2 q + b of the row's 16 per
    step (NVFP4), or 4 half + q of its 8 (MXFP4)."""
    steps = k // 256
    codes = (e, n // 32, 2, 2, 8, steps, 2, 4, 16)
    if mx:
        return codes, (e, n // 32, 2, 2, 8, steps, 2, 4), (0, 1, 5, 4, 7, 2, 3, 6)
    return codes, (e, n // 32, 2, 2, 8, steps, 2, 4, 2), (0, 1, 5, 4, 7, 2, 3, 6, 8)


CODES_ORDER = (0, 1, 5, 2, 3, 6, 4, 7, 8)
"""[e, tile, step, t, h, half, g, q, b]: load (t, h, half) of lane 4 g + q at 512 (4 t + 2 h + half) + 16 (4 g + q)."""


def pack(weight: FP4Tensor) -> PackedWeight:
    """``weight`` (NVFP4 or MXFP4, [E, N, K], N a multiple of 32 and K of 256) in the kernel's packed layout: a
    permutation of its bytes, one copy. ``grouped_mm`` takes either; the packed one streams faster (BENCHMARKS.md,
    session 26). Pack once per weight update, not per call. Raises ``ValueError`` for shapes the kernel cannot run."""
    if weight.fmt not in ("nvfp4", "mxfp4") or len(weight.shape) != 3:
        raise ValueError(f"pack needs an NVFP4 or MXFP4 weight of shape [E, N, K], got {weight.fmt} "
                         f"{tuple(weight.shape)}")
    e, n, k = weight.shape
    if k % 256 or n % 32:
        raise ValueError(f"pack needs K a multiple of 256 and N of 32, got K={k}, N={n}")
    cv, sv, sp = _pack_views(e, n, k, weight.fmt == "mxfp4")
    codes = weight.codes.reshape(cv).permute(CODES_ORDER).contiguous().flatten()
    scales = weight.block_scales.reshape(sv).permute(sp).contiguous().flatten()
    return PackedWeight(weight.fmt, (e, n, k), codes, scales, weight.global_amax)


def unpack(packed: PackedWeight) -> FP4Tensor:
    """The FP4Tensor ``pack`` (or ``moe_wgmma.pack``, by ``packed.layout``) was given."""
    if packed.layout == "wgmma":
        from . import moe_wgmma

        return moe_wgmma.unpack(packed)
    e, n, k = packed.shape
    cv, sv, sp = _pack_views(e, n, k, packed.fmt == "mxfp4")
    codes = packed.codes.view([cv[i] for i in CODES_ORDER]).permute(_inverse(CODES_ORDER)).reshape(e, n, k // 2)
    scales = packed.block_scales.view([sv[i] for i in sp]).permute(_inverse(sp)).reshape(e, n, -1)
    return FP4Tensor(block_scales=scales, global_amax=packed.global_amax, shape=torch.Size((e, n, k)), fmt=packed.fmt,
                     codes=codes)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(i) for i in range(len(order)))


def token_tile(k: int, balanced: bool = False) -> int:
    """Token rows per pass for reduction length ``k`` (0: K too long for 8 rows); ``balanced``: next to the balanced
    split's ``BALANCED_SMEM`` bytes."""
    for tt in (16, 8):
        if tt * (2 * k + 32) + (BALANCED_SMEM if balanced else 0) <= SMEM_LIMIT:
            return tt
    return 0


BALANCED_SMEM = 8 * (8 + 1 + 3)
"""Shared memory of the balanced split after the token rows: the scan's 8 warp sums, the expert pick, the segment."""


CTAS_PER_SM = 2  # (MIN_BLOCKS in the source: 128 registers per thread)
BALANCED = True
"""The kernel deals the row blocks of all experts with tokens to one wave of CTAs in equal shares of work (blocks x
passes; experts without tokens take no CTA), instead of one grid row of CTAs per expert (``row_blocks_per_cta``),
where routing that leaves experts empty idles their CTAs' multiprocessors (session 24's end-to-end decode). Up to
``THREADS`` experts (a thread per expert)."""
GRID_CTAS: int | None = None
"""CTAs of the balanced split (None: ``CTAS_PER_SM`` per multiprocessor, one wave). Tests set it small."""


def row_blocks_per_cta(experts: int, n: int, device) -> int:
    """Blocks of 256 weight rows one CTA streams in sequence: as many as leave about one wave of CTAs when every
    expert has tokens (a CTA's first loads wait on memory with nothing to overlap them; fewer, longer CTAs pay that
    once per wave instead of once per block)."""
    per_expert = max(1, CTAS_PER_SM * sm_count(device) // max(experts, 1))
    return cdiv(cdiv(n, ROWS_PER_CTA), per_expert)


AUTO = True
"""Whether ``fp4_grouped_mm(gemm="auto")`` runs this kernel where ``preferred`` and the caller has the weights in
``pack``'s layout too (``packed=``; the rollout's ``ExpertWeightStore.packed`` provides them while this is on). On:
session 26 measured the end-to-end FP4 decode of the Qwen3-30B-A3B-shaped model (graph-replayed steps) 3.5-5% faster
with it at batch 4-64 than with the Triton GEMM, and unchanged at 256 (where it is not preferred)."""
MIN_ROWS = 32


def preferred(rows: int, weight: FP4Tensor | PackedWeight) -> bool:
    """Where ``gemm="auto"`` runs this kernel with ``AUTO`` on: decode sizes where the balanced split has work for
    most multiprocessors and one token pass holds most experts: MIN_ROWS <= rows <= tt / 2 x experts for token
    passes of tt (16, or 8 where K is long). Session 26's routing bench (random top-8) measured the packed kernel
    faster than the Triton kernel from 4 to 128 tokens per batch (32 to 1024 rows) at Qwen3-30B-A3B's FC1 (tt 16,
    128 experts) and DeepSeek-V3's (tt 8, 256 experts), and slower at 1 and 256 tokens. Needs at most ``THREADS``
    experts (the balanced split)."""
    experts, _, k = weight.shape
    tt = token_tile(k, balanced=True)
    return AUTO and experts <= THREADS and tt > 0 and MIN_ROWS <= rows <= tt // 2 * experts


def unsupported(x, weight: FP4Tensor | PackedWeight, out_dtype: torch.dtype | None = None) -> str | None:
    """Why ``grouped_mm`` cannot run this call (None: it can)."""
    if isinstance(weight, PackedWeight) and weight.layout != "mma":
        return f"weight packed for {weight.layout!r} (moe_wgmma), not this kernel's 'mma' layout"
    dev = weight.codes.device
    if dev.type != "cuda":
        return f"weights are on {dev}, the CUDA kernel needs a GPU"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} < 9.0 (the dequantization uses bf16x2 multiplies)"
    smem = _shared_memory_optin(index)
    if smem < SMEM_LIMIT:  # e.g. sm_120 (RTX 50xx, GB10): 99 KiB per block
        return f"the GPU allows {smem} bytes of shared memory per block, the kernel takes {SMEM_LIMIT}"
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


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def _shared_memory_optin(device_index: int) -> int:
    """The most shared memory one block may opt in to on the device (bytes)."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT))


DEFINES: tuple[str, ...] = ()
"""Extra ``NAME=value`` macros for the source (``MIN_BLOCKS``, ``SKIP_DEQUANT``, ``PROBE_CONTIGUOUS``: the build
variants ``benchmarks/bench_moe_mma.py`` times; the last two give wrong numbers)."""


def check_defines(defines: tuple[str, ...], source: str) -> None:
    """ValueError for a ``NAME[=value]`` of ``defines`` whose NAME ``source`` does not read (``#ifndef NAME``): the
    compiler would build the default kernel, timed and reported under that variant's name."""
    known = re.findall(r"^#ifndef (\w+)", source, re.MULTILINE)
    unknown = [d for d in defines if d.split("=", 1)[0] not in known]
    if unknown:
        raise ValueError(f"defines {unknown}: the source reads none of them; each must be NAME=value with NAME one "
                         f"of {known}")


@functools.cache
def _kernel(device_index: int, mx: bool, packed: bool, balanced: bool, steps: int, defines: tuple[str, ...] = ()):
    """The kernel for one format, layout, split and K / 256 (a constant in the build: one compile per K)."""
    from torch.cuda import _compile_kernel

    check_defines(defines, SOURCE.read_text())
    with torch.cuda.device(device_index):
        name = f"fp4_w4a16_mma<{int(mx)}, {int(packed)}, {int(balanced)}, {steps}>"
        opts = ["-std=c++17", *(f"-D{d}" for d in defines)]
        kern = _compile_kernel(SOURCE.read_text(), name, nvcc_options=opts)
        kern.set_shared_memory_config(SMEM_LIMIT)
    logger.info("compiled %s for cuda:%d", name, device_index)
    return kern


def grouped_mm(x, weight: FP4Tensor | PackedWeight, offs: torch.Tensor, *,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W4A16 grouped GEMM (``moe`` has the layout): bf16 or fp32 out. ``x`` may be an FP4Tensor (W4A4 emulation:
    dequantized to bf16 first). ``weight`` as an FP4Tensor or in ``pack``'s layout (the same bits out). Raises
    ``ValueError`` naming the reason where ``unsupported`` is not None."""
    why = unsupported(x, weight, out_dtype)
    if why:
        raise ValueError(f"the CUDA FP4 grouped GEMM cannot run this call: {why}")
    xd, y, offs32 = launch_operands(x, weight, offs, out_dtype)
    e, n, k = weight.shape
    t = xd.shape[0]
    if t == 0:
        return y
    codes, scales, g_arg, gmode = weight_operands(weight)
    tt = token_tile(k)
    dev = xd.device.index if xd.device.index is not None else torch.cuda.current_device()
    smem = tt * (2 * k + 32)
    balanced = BALANCED and e <= THREADS and token_tile(k, True) == tt  # (not at the cost of token rows)
    kern = _kernel(dev, weight.fmt == "mxfp4", isinstance(weight, PackedWeight), balanced, k // 256, DEFINES)
    if balanced:  # (grid row 1 zeroes the rows of no expert)
        tiles, grid = 0, (max(1, GRID_CTAS or CTAS_PER_SM * sm_count(xd.device)), 2, 1)
        smem += BALANCED_SMEM
    else:
        tiles = row_blocks_per_cta(e, n, xd.device)
        grid = (cdiv(n, ROWS_PER_CTA * tiles), e + 1, 1)
    args = [xd, codes, scales, g_arg, y, offs32, t, n, k, e, xd.stride(0), y.stride(0), gmode,
            int(y.dtype == torch.float32), tt, tiles]
    cuda_launch.launch(kern.func, grid, (THREADS, 1, 1), smem, cuda_launch.current_stream(xd.device), args)
    return y


def launch_operands(x, weight, offs: torch.Tensor, out_dtype: torch.dtype | None):
    """(x as bf16 rows the kernels' 16-byte loads can read, the output [T, N], int32 offs) of a CUDA GEMM call
    (shared with ``moe_wgmma``)."""
    xd = gpu_activations(x)
    _, n, _ = check_grouped_args(xd, weight, offs)
    if xd.stride(0) % 8 or xd.stride(1) != 1:  # (16-byte loads of each token row)
        # a fresh tensor: .contiguous() keeps a [1, K] view's odd row stride (a size-1 dim's stride is free)
        xd = torch.empty(xd.shape, dtype=xd.dtype, device=xd.device).copy_(xd)
    y = torch.empty(xd.shape[0], n, dtype=out_dtype or torch.bfloat16, device=xd.device)
    return _aligned(xd), y, (offs if offs.dtype == torch.int32 else offs.to(torch.int32)).contiguous()


def weight_operands(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(codes, scales as 16-byte-aligned bytes, the global amax argument, its mode: 0 none, 1 per tensor, 2 per row)."""
    g = weight.global_amax
    codes = _aligned(weight.codes.contiguous().view(torch.uint8))
    scales = _aligned(weight.block_scales.contiguous().view(torch.uint8))
    mode = 0 if g is None else (1 if g.dim() == 0 else 2)
    return codes, scales, scales if g is None else g.float().contiguous(), mode


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied where a view's offset leaves its start off the kernel's 16-byte loads."""
    return t if t.data_ptr() % 16 == 0 else t.clone()
