"""CUDA FP4-weight grouped GEMM for many tokens per expert (W4A16, sm_90a wgmma): ``moe_wgmma.cu``, compiled at first
use by NVRTC together with ``moe_mma.cu`` (whose helpers it uses).

The same contract as ``moe_mma.grouped_mm`` (layout in ``moe``): ``y = x_e @ W_e^T`` in fp32, cast once, rows past
``offs[-1]`` zero. ``moe_mma``'s kernel streams the weights once per pass of up to 16 tokens on mma.sync, which suits
decode; at prefill sizes (hundreds of tokens per expert) the GEMM is bound by the tensor cores instead, and Hopper's
fast path to them is wgmma. Here a CTA (two warpgroups) takes 128 weight rows of one expert and its tokens in tiles of
128 or 256: the weights are dequantized in registers into wgmma's A operand (rows = M), the token tile comes by TMA to
shared memory (N), and the dequantization of one K stage overlaps the MMAs of the previous one. The grid is persistent
(``PERSISTENT``): one CTA per multiprocessor takes the 128-row x expert items from a counter and starts the next tile's
loads under the current one's last stages. On one H200 (session 28, NVFP4, the same tokens on every expert) it runs at
1.19x / 1.06x bf16 ``torch._grouped_mm`` on Qwen3-30B-A3B's FC1 at 128 / 256 tokens per expert (the Triton kernel:
0.89x / 0.60x), 1.12x / 1.02x on its FC2, 1.14x / 1.05x on DeepSeek-V3's FC1.

Weights must be in this module's layout (``pack``: a nibble permutation of the FP4Tensor, so that each 32-bit word is
one lane's A fragment of one k16 step); ``PackedWeight.layout`` is then ``"wgmma"``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from ..formats import e2m1
from ..formats.tensor import FP4Tensor
from . import cuda_launch, moe_mma
from .dispatch import sm_count

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe_wgmma.cu")
LAYOUT = "wgmma"
ROWS_PER_CTA = 128
THREADS = 256
X_STAGES = 4  # (XS in the source)
TOKEN_TILES = (128, 256)
DEFINES: tuple[str, ...] = ()
"""Extra ``NAME=value`` macros (``XS``, ``SKIP_DEQUANT``: build variants the benchmark times)."""

# codes of one expert [N, K] viewed as [N/16, rh, g, S, j, kh, q, kp] (row 16 nb + 8 rh + g, k 64 s + 16 j + 8 kh +
# 2 q + kp) -> [nb, s, g, q, j, kp, kh, rh]: lane 4 g + q's word j, nibble 4 kp + 2 kh + rh
_CODES_ORDER = (0, 3, 2, 6, 4, 7, 5, 1)
# scales of one expert [N, K/B] viewed as [N/16, rh, g, S, b] (b: the stage's 4 NVFP4 or 2 MXFP4 blocks)
# -> [nb, s, g, b, rh]
_SCALES_ORDER = (0, 3, 2, 4, 1)


def _views(n: int, k: int, mx: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (n // 16, 2, 8, k // 64, 4, 2, 4, 2), (n // 16, 2, 8, k // 64, 2 if mx else 4)


def _check_shape(weight) -> tuple[int, int, int]:
    if weight.fmt not in ("nvfp4", "mxfp4") or len(weight.shape) != 3:
        raise ValueError(f"moe_wgmma needs an NVFP4 or MXFP4 weight of shape [E, N, K], got {weight.fmt} "
                         f"{tuple(weight.shape)}")
    e, n, k = weight.shape
    if k % 256 or n % ROWS_PER_CTA:
        raise ValueError(f"moe_wgmma needs K a multiple of 256 and N of {ROWS_PER_CTA}, got K={k}, N={n}")
    return e, n, k


def pack(weight: FP4Tensor) -> moe_mma.PackedWeight:
    """``weight`` ([E, N, K], N a multiple of 128, K of 256) in this kernel's layout (one copy; the codes' nibbles
    and the scales' bytes permuted, nothing else). Pack once per weight update. Raises ``ValueError`` for shapes the
    kernel cannot run."""
    e, n, k = _check_shape(weight)
    cv, sv = _views(n, k, weight.fmt == "mxfp4")
    codes = torch.empty_like(weight.codes).view(e, -1)
    scales = torch.empty_like(weight.block_scales).view(e, -1)
    for i in range(e):  # (an expert at a time: the unpacked codes take a byte per element)
        c = e2m1.unpack(weight.codes[i]).reshape(cv).permute(_CODES_ORDER).flatten()
        codes[i] = e2m1.pack(c)
        scales[i] = weight.block_scales[i].reshape(sv).permute(_SCALES_ORDER).flatten()
    return moe_mma.PackedWeight(weight.fmt, (e, n, k), codes.flatten(), scales.flatten(), weight.global_amax, LAYOUT)


def unpack(packed: moe_mma.PackedWeight) -> FP4Tensor:
    """The FP4Tensor ``pack`` was given."""
    e, n, k = packed.shape
    cv, sv = _views(n, k, packed.fmt == "mxfp4")
    inv_c = tuple(_CODES_ORDER.index(i) for i in range(len(cv)))
    inv_s = tuple(_SCALES_ORDER.index(i) for i in range(len(sv)))
    codes = packed.codes.view(e, -1)
    scales = packed.block_scales.view(e, -1)
    out_c = torch.empty_like(codes).view(e, n, k // 2)
    out_s = torch.empty_like(scales).view(e, n, -1)
    for i in range(e):
        c = e2m1.unpack(codes[i]).view([cv[j] for j in _CODES_ORDER]).permute(inv_c).reshape(n, k)
        out_c[i] = e2m1.pack(c)
        out_s[i] = scales[i].view([sv[j] for j in _SCALES_ORDER]).permute(inv_s).reshape(n, -1)
    return FP4Tensor(block_scales=out_s, global_amax=packed.global_amax, shape=torch.Size((e, n, k)),
                     fmt=packed.fmt, codes=out_c)


def unsupported(x, weight, out_dtype: torch.dtype | None = None) -> str | None:
    """Why ``grouped_mm`` cannot run this call (None: it can)."""
    if not isinstance(weight, moe_mma.PackedWeight) or weight.layout != LAYOUT:
        return f"weight must be packed by moe_wgmma.pack (layout {LAYOUT!r}), got {type(weight).__name__}"
    dev = weight.codes.device
    if dev.type != "cuda":
        return f"weights are on {dev}, the CUDA kernel needs a GPU"
    cap = moe_mma._capability(dev.index if dev.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: wgmma is built for sm_90a (9.0) only"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC; torch >= 2.8)"
    dt = out_dtype or torch.bfloat16
    if dt not in moe_mma.OUT_DTYPES:
        return f"out_dtype {dt} (supported: bfloat16, float32)"
    return None


def token_tile(rows: int, experts: int) -> int:
    """Tokens per CTA tile: 256 where the experts average more than 128 tokens, else 128 (session 27, calls 4-5,
    Qwen3-30B-A3B's FC1 / FC2: 128 the faster tile at 128 tokens per expert, 256 at 192 and 256)."""
    return 256 if rows > 128 * max(experts, 1) else 128


AUTO = True
"""Whether ``fp4_grouped_mm(gemm="auto")`` runs this kernel where ``preferred`` and the caller passes weights in this
layout (``packed=``)."""
MIN_TOKENS_PER_EXPERT = 64
PERSISTENT = True
"""One CTA per multiprocessor, each taking the next 128-row x expert item from a counter as it finishes one and
starting the next tile's loads under the current one's last stages (False: a CTA per item)."""


def preferred(rows: int, weight) -> bool:
    """From 64 tokens per expert on average (session 28, call 7, Qwen3-30B-A3B's shapes). With the same tokens on
    every expert the Triton kernel is faster at exactly 64 (1.60x / 1.62x bf16 on FC1 / FC2 against 1.27x / 1.14x),
    where its 64-token tile fits, and slower from 72 (0.93x / 0.90x against 1.24x / 1.14x). Under random top-8
    routing some experts get more than 64 and cost the Triton kernel a second tile: the rollout's experts forward at
    64 tokens per expert on average runs 1.10x faster on this kernel."""
    return AUTO and rows >= MIN_TOKENS_PER_EXPERT * max(weight.shape[0], 1)


def shared_memory(bt: int, stages: int = X_STAGES) -> int:
    """Token slots, the epilogue's tile (``bt`` tokens of bf16 or 128 of fp32), the slots' mbarriers, 1024 for the
    slots' alignment."""
    return stages * bt * 128 + max(bt * (128 * 2 + 16), 128 * (128 * 4 + 16)) + 8 * stages + 1024


def _stages(defines: tuple[str, ...]) -> int:
    return next((int(d.split("=")[1]) for d in defines if d.startswith("XS=")), X_STAGES)


_TMAP_BF16, _TMAP_SWIZZLE_128B, _TMAP_L2_256B = 9, 3, 3  # (CUtensorMapDataType, CUtensorMapSwizzle, ...L2promotion)


def tensor_map(x: torch.Tensor, bt: int) -> ctypes.Array:
    """The CUtensorMap of bf16 x [T, K] (row stride a multiple of 8 elements) for TMA boxes of 64 k x ``bt`` rows in
    128-byte swizzle, rows past T read as zeros (``cuTensorMapEncodeTiled``; a kernel parameter, so CUDA graphs
    capture it by value)."""
    lib = cuda_launch.driver()
    tmap = (ctypes.c_uint64 * 16)()
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    res = lib.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), _TMAP_BF16, 2, ctypes.c_void_p(x.data_ptr()), u64x2(x.shape[1], x.shape[0]),
        (ctypes.c_uint64 * 1)(x.stride(0) * 2), u32x2(64, bt), u32x2(1, 1), 0, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {res} for x {tuple(x.shape)} stride "
                           f"{x.stride()}, box 64 x {bt}")
    return tmap


def ctas(items: int, device: torch.device) -> int:
    """The grid for ``items`` (N / 128 x E) CTA tiles: at most one CTA per multiprocessor where ``PERSISTENT``."""
    if not PERSISTENT:
        return items
    return min(items, sm_count(device))


@functools.cache
def _kernel(device_index: int, mx: bool, bt: int, stages: int, defines: tuple[str, ...] = ()):
    """The kernel for one format, token tile and K / 64 (one compile each)."""
    from torch.cuda import _compile_kernel

    src = moe_mma.SOURCE.read_text() + "\n" + SOURCE.read_text()
    moe_mma.check_defines(defines, src)
    with torch.cuda.device(device_index):
        name = f"fp4_w4a16_wgmma<{int(mx)}, {bt}, {stages}>"
        kern = _compile_kernel(src, name, compute_capability="90a",
                               nvcc_options=["-std=c++17", *(f"-D{d}" for d in defines)])
        kern.set_shared_memory_config(shared_memory(bt, _stages(defines)))
    logger.info("compiled %s for cuda:%d", name, device_index)
    return kern


def grouped_mm(x, weight: moe_mma.PackedWeight, offs: torch.Tensor, *, out_dtype: torch.dtype | None = None,
               bt: int | None = None, grid: int | None = None) -> torch.Tensor:
    """W4A16 grouped GEMM on ``pack``'s weights: bf16 or fp32 out. ``x`` may be an FP4Tensor (W4A4 emulation:
    dequantized to bf16 first). ``bt`` overrides ``token_tile``, ``grid`` the number of CTAs (``ctas``; any
    positive number gives the same bits). Raises ``ValueError`` naming the reason where ``unsupported`` is not
    None."""
    if grid is not None and grid < 1:
        raise ValueError(f"grid={grid} must be a positive number of CTAs")
    why = unsupported(x, weight, out_dtype)
    if why:
        raise ValueError(f"the wgmma FP4 grouped GEMM cannot run this call: {why}")
    xd, y, offs32 = moe_mma.launch_operands(x, weight, offs, out_dtype)
    e, n, k = weight.shape
    t = xd.shape[0]
    if t == 0:
        return y
    bt = bt or token_tile(t, e)
    if bt not in TOKEN_TILES:
        raise ValueError(f"bt={bt} must be one of {TOKEN_TILES}")
    codes, scales, g_arg, gmode = moe_mma.weight_operands(weight)
    dev = xd.device.index if xd.device.index is not None else torch.cuda.current_device()
    kern = _kernel(dev, weight.fmt == "mxfp4", bt, k // 64, DEFINES)
    grid = grid or ctas(n // ROWS_PER_CTA * e, xd.device)
    # the next item to hand out (CTA b's first is b), then a mailbox per CTA
    ctr = torch.full((1 + grid,), grid, dtype=torch.int32, device=xd.device)
    args = [xd, codes, scales, g_arg, y, offs32, t, n, k, e, xd.stride(0), y.stride(0), gmode,
            int(y.dtype == torch.float32), ctr]
    cuda_launch.launch(kern.func, (grid, 1, 1), (THREADS, 1, 1), shared_memory(bt, _stages(DEFINES)),
                       cuda_launch.current_stream(xd.device), [tensor_map(xd, bt), *args])  # (the map by value)
    return y
