"""Host side of ``quant_pair_triton.pair_kernel``: its launch (``launch_pair``, called by ``quant_triton.run_quant``;
``prepare``: a launch kept for repeated writes), its launch config (``config_name``: an entry of
``quant_triton.CONFIG``) and which tile it takes (``_by_magnitude``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import quant_triton as qk
from .dispatch import cdiv
from .quant_pair_triton import pair_kernel
from .quant_triton import RNE


def launch_pair(x2d, out, **kwargs) -> None:
    """Launch ``pair_kernel`` on x2d into the buffers of ``out`` (``prepare``'s arguments)."""
    prepare(x2d, out, **kwargs)(x2d)


def prepare(x2d, out, *, g, scales_in, guide, err, spare, fmt, block, mode, g_mode, write_codes, write_scales,
            write_bits, write_mask, fast_div, out_step: int | None = None,
            out_row: torch.Tensor | None = None) -> Callable[[torch.Tensor], None]:
    """The launch of ``pair_kernel`` into the buffers of ``out`` for rows like x2d, as a function of the rows: every
    argument but x's pointer and row stride decided here (a caller that launches the same write again keeps it).
    Rows given later must have x2d's shape, dtype, device and alignment (``quant_triton.pair_ok``). ``out_step``:
    out's codes / scales (and a computed amax, ``g``) hold row r at row r * out_step (RNE only; None: row r, the
    kernel other callers compile); ``out_row`` (int64 [1] on the device, with ``out_step``): at row
    r * out_step + out_row[0]."""
    if out_step is not None and int(mode) != int(RNE):
        raise ValueError(f"out_step={out_step} needs RNE rounding, got mode={int(mode)}")
    if out_row is not None and (out_step is None or out_row.dtype != torch.int64 or out_row.numel() != 1
                                or out_row.device != x2d.device):
        raise ValueError(f"out_row must be int64 [1] on {x2d.device} with out_step, got {out_row.dtype} "
                         f"{tuple(out_row.shape)} on {out_row.device}, out_step={out_step}")
    m, k = x2d.shape
    nb = k // block
    xdt, wdt = qk._WORD[x2d.dtype]
    deq = out.get("deq")
    mask = out.get("mask")
    cfg = qk.CONFIG[config_name(fmt, mode, deq is not None)]
    bm, nbt, num_kt = qk.plan(k, block, cfg["tile"])
    grid = cdiv(m, bm)
    per_sm = cfg.get("programs_per_sm")
    prefetch = bool(per_sm) and num_kt == 1 and out_step is None
    if prefetch:
        grid = min(grid, per_sm * qk.multiprocessors(x2d))
    head = (nb, num_kt, g if g is not None else spare, scales_in if scales_in is not None else spare,
            guide if guide is not None else spare, out.get("codes", spare), out.get("scales", spare),
            out.get("bits", spare))
    tail = (mask.view(torch.int16) if mask is not None else spare, mask if mask is not None else spare,
            err if err is not None else spare)
    options = dict(
        XDT=xdt, FMT=int(fmt), MODE=int(mode), G_MODE=int(g_mode), B=block, BLOCK_M=bm, NBT=nbt,
        WRITE_CODES=write_codes, WRITE_SCALES=write_scales, WRITE_BITS=write_bits, WRITE_DEQ=deq is not None,
        WRITE_MASK=write_mask, CHECK_FINITE=err is not None, FAST_DIV=fast_div, HW_CVT=not qk.interpreting(x2d),
        BY_MAG=_by_magnitude(mode, fmt, xdt, write_bits, deq is not None or write_mask), EVEN_K=nb == nbt * num_kt,
        out_step=1 if out_step is None else out_step, OUT_ROWS=out_step is not None,
        row_ptr=out_row if out_row is not None else spare, ROW_AT=out_row is not None,
        PREFETCH=prefetch, num_warps=cfg["num_warps"], enable_fp_fusion=False, **qk.register_cap(cfg, x2d),
    )
    launch = pair_kernel[(grid,)]

    def run(rows: torch.Tensor) -> None:
        xw = rows.view(wdt)
        launch(xw, rows, m, xw.stride(0), *head, deq.view(wdt) if deq is not None else xw,
               deq if deq is not None else rows, *tail, **options)

    return run


def config_name(fmt, mode, deq: bool) -> str:
    """``quant_triton.CONFIG``'s entry for ``pair_kernel``: "pair_mxfp4", "pair_guided" (NVFP4 guided rounding:
    TRACE's fake-quant forward), "pair_fake" (NVFP4 RNE with a dequantized output: plain QAT's) or
    "pair" (the other NVFP4 calls: quantize, record, the FP4 KV cache's writes)."""
    if int(fmt) != 0:
        return "pair_mxfp4"
    if int(mode) != int(RNE):
        return "pair_guided"
    return "pair_fake" if deq and int(mode) == int(RNE) else "pair"


def _by_magnitude(mode, fmt, xdt, write_bits, fake_quant: bool = False) -> bool:
    """Whether ``pair_kernel`` takes a tile by fp32 magnitudes: NVFP4 RNE (``quant_triton.RNE_BY_MAGNITUDE``) or
    guided (compact or full) without bits (``GUIDED_BY_MAGNITUDE``), bf16/fp32 x; or MXFP4 RNE codes (and bits) of
    bf16 x by packed pairs (``quant_mx_triton``; also ``RNE_BY_MAGNITUDE``), not for a fake-quant output or mask."""
    if int(fmt) != 0:
        return bool(qk.RNE_BY_MAGNITUDE) and int(mode) == int(RNE) and xdt == 0 and not fake_quant
    if xdt == 1:
        return False
    if int(mode) == int(RNE):
        return bool(qk.RNE_BY_MAGNITUDE)
    return bool(qk.GUIDED_BY_MAGNITUDE and not write_bits)
