"""SGLang's FP4 KV-cache format (``--kv-cache-dtype fp4_e2m1``, SGLang 0.5.10): reference and record layout.

What SGLang stores (``MHATokenToKVPoolFP4.set_kv_buffer`` -> ``KVFP4QuantizeUtil.batched_quantize``,
``sglang/srt/layers/quantization/kvfp4_tensor.py``) for one token's K (or V) [kv_heads, head_dim]:

  blocks     16 consecutive elements of the flattened [kv_heads * head_dim] row (= 16 along head_dim
             when head_dim % 16 == 0); no global amax
  exponent   e = ceil(log2(max(amax_block / 6, 1e-10))), computed in ``compute_dtype`` (each op
             rounds to it); stored as uint8 e + 127 (the E8M0 bit pattern: ``float8_e8m0fnu``)
             -> an all-zero block gets e = -33 (scale byte 94), not the minimum exponent
  elements   z = x / 2**e (in compute_dtype); code = (z < 0) << 3 | #{b in (0.25, 0.75, 1.25, 1.75,
             2.5, 3.5, 5) : |z| >= b}: round to nearest with ties AWAY from zero (0.25 -> 0.5,
             2.5 -> 3, not RNE), saturating at 6; the sign bit is set only for z < 0 (so -0.0 gives
             code 0, a small negative value gives code 8 = -0)
  packing    element 2i in the low nibble (as ``e2m1.pack``)
  decode     grid value * 2**(byte - 127) in float32, then one cast to the cache dtype

``compute_dtype``: SGLang decorates the function with ``torch.compile``; eager execution (dynamo
disabled) computes in the input dtype (bf16 for a bf16 model), inductor computes the pointwise
math in float32 (``compute_dtype=torch.float32``). The two differ only where bf16 rounding of
``amax / 6`` or of its log2 moves the exponent. ``torch.log2`` itself is used for the exponent
(as SGLang does): in float32 it can round ``log2(t)`` to an integer for ``t`` a few ulps above a
power of two (|log2 t| >= 4); such blocks keep the smaller exponent and their largest elements
saturate to 6.

This is not NVFP4 nor OCP MXFP4 (block 16 with E8M0 scales, ceil rule, ties away): records in
this format carry ``fmt="sglang_kvfp4"`` and must not be consumed as ``TraceConfig.format``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import block, e2m1
from .constants import E2M1_MAX, E8M0_BIAS
from .quantizer import clip_mask, ste_backward
from .tensor import CompactGuidance, FP4Tensor, FullGuidance, GuidanceMismatchError

NAME = "sglang_kvfp4"
BLOCK = 16
MIN_RATIO = 1e-10
"""SGLang's clamp of amax / 6 (keeps log2 finite for all-zero blocks)."""
BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between adjacent E2M1 magnitudes; |z| >= bound moves one code up (ties away from zero)."""
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)


class SGLangKVFP4Format:
    """The format object (same interface as ``nvfp4.FORMAT`` / ``mxfp4.MXFP4Format``); float32 math."""

    name = NAME
    block_size = BLOCK
    scale_dtype = torch.float8_e8m0fnu

    def global_amax(self, x, *, global_amax=None, per_row=False):
        if global_amax is not None or per_row:
            raise ValueError(f"{NAME} has no global amax: leave global_amax=None and per_row=False")
        return None

    def check_global_amax(self, g, x) -> None:
        if g is not None:
            raise GuidanceMismatchError(f"a {NAME} record must not carry a global_amax")

    def block_scales(self, xb: torch.Tensor, g) -> torch.Tensor:
        return _scale_bytes(_exponents(xb, torch.float32)).view(self.scale_dtype)

    def scale_values(self, xb, scales, g):
        return xb / _pow2(scales).unsqueeze(-1)

    def unscale(self, q, scales, g):
        return q * _pow2(scales).unsqueeze(-1)


FORMAT = SGLangKVFP4Format()


def _exponents(xb: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """Blocks [..., nb, 16] -> exponents e [..., nb] (float, in ``cd``), SGLang's order of operations."""
    amax = xb.to(cd).abs().amax(-1)
    ratio = torch.clamp(amax / E2M1_MAX, min=MIN_RATIO)  # rounds to cd
    return torch.ceil(torch.log2(ratio))


def _scale_bytes(e: torch.Tensor) -> torch.Tensor:
    return (e + E8M0_BIAS).to(torch.uint8)


def _pow2(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes -> float32 2**(byte - 127) (exact, also for the subnormal 2**-127)."""
    return torch.exp2(scales.view(torch.uint8).float() - E8M0_BIAS)


def encode_ties_away(z: torch.Tensor) -> torch.Tensor:
    """Scaled values -> unpacked E2M1 codes: nearest, ties away from zero, saturating; sign iff z < 0."""
    bounds = torch.tensor(BOUNDS, dtype=torch.float32, device=z.device)
    mag = (z.float().abs().unsqueeze(-1) >= bounds).sum(-1).to(torch.uint8)
    return mag | ((z < 0).to(torch.uint8) << 3)


def _check(x: torch.Tensor, compute_dtype: torch.dtype) -> None:
    block.check_input(x)
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype} is not one of {COMPUTE_DTYPES} (float16 is not "
                         "supported: SGLang's scale of an all-zero block is log2(0) cast to uint8 there)")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{NAME} needs the last dim to be a multiple of {BLOCK} (SGLang views the row as "
                         f"blocks of {BLOCK}), got shape {tuple(x.shape)}")


def quantize(x: torch.Tensor, *, compute_dtype: torch.dtype | None = None) -> FP4Tensor:
    """x [..., K] (K % 16 == 0; a KV row flattened to [kv_heads * head_dim]) -> FP4Tensor(fmt="sglang_kvfp4").

    ``compute_dtype``: None = x.dtype (SGLang run eagerly), ``torch.float32`` = SGLang compiled by
    inductor. codes uint8 [..., K/2], block_scales float8_e8m0fnu [..., K/16], global_amax None.
    """
    cd = x.dtype if compute_dtype is None else compute_dtype
    _check(x, cd)
    xb = x.to(cd).unflatten(-1, (-1, BLOCK))  # [..., nb, 16]
    e = _exponents(xb, cd)  # [..., nb]
    z = xb / torch.exp2(e).unsqueeze(-1)  # in cd, exact unless it underflows
    codes = encode_ties_away(z).flatten(-2)
    return FP4Tensor(codes=e2m1.pack(codes), block_scales=_scale_bytes(e).view(FORMAT.scale_dtype),
                     global_amax=None, shape=tuple(x.shape), fmt=NAME)


def dequantize(q, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An ``sglang_kvfp4`` FP4Tensor (or record with codes) -> values [..., K] in ``dtype`` (float32 math)."""
    if q.fmt != NAME:
        raise ValueError(f"expected a {NAME} tensor, got fmt={q.fmt!r}")
    v = e2m1.decode(e2m1.unpack(q.codes)).unflatten(-1, (-1, BLOCK))
    return FORMAT.unscale(v, q.block_scales, None).flatten(-2)[..., : q.shape[-1]].to(dtype)


def from_sglang(packed: torch.Tensor, scales: torch.Tensor) -> FP4Tensor:
    """SGLang's KV pool rows -> FP4Tensor [T, kv_heads, head_dim].

    ``packed``: uint8 [T, kv_heads, head_dim/2] (``k_buffer[layer][slots]``), ``scales``: uint8
    [T, kv_heads*head_dim/16] (``k_scale_buffer[layer][slots]``)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8 or packed.dim() != 3 or scales.dim() != 2:
        raise ValueError(f"expected uint8 packed [T, heads, head_dim/2] and uint8 scales [T, heads*head_dim/16], "
                         f"got {packed.dtype} {tuple(packed.shape)} and {scales.dtype} {tuple(scales.shape)}")
    t, h, half = packed.shape
    if (2 * half) % BLOCK or tuple(scales.shape) != (t, h * 2 * half // BLOCK):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit packed {tuple(packed.shape)} "
                         f"(head_dim {2 * half} must be a multiple of {BLOCK})")
    return FP4Tensor(codes=packed, block_scales=scales.reshape(t, h, 2 * half // BLOCK).view(FORMAT.scale_dtype),
                     global_amax=None, shape=(t, h, 2 * half), fmt=NAME)


def to_sglang(q: FP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4Tensor [T, kv_heads, head_dim] -> (packed [T, heads, head_dim/2], scales uint8 [T, heads*head_dim/16])."""
    if q.fmt != NAME or len(q.shape) != 3:
        raise ValueError(f"expected a {NAME} tensor [T, heads, head_dim], got {q.fmt} {tuple(q.shape)}")
    return q.codes, q.block_scales.view(torch.uint8).reshape(q.shape[0], q.shape[1] * q.shape[2] // BLOCK)


def guided_quantize(x: torch.Tensor, guidance) -> FP4Tensor:
    """Guided rounding toward an ``sglang_kvfp4`` record, with its scales (float32 math)."""
    return block.guided_quantize_with_z(FORMAT, x, guidance)[0]


@dataclass(frozen=True)
class SGLangKVQuantizer:
    """K/V in this format (``TraceConfig.kv_format="sglang_kvfp4"``), with ``formats.Quantizer``'s interface.

    Own rounding: ``quantize(x, compute_dtype=torch.float32)`` (SGLang's compiled quantizer:
    E8M0 ceil scales per 16 elements, ties away from zero; ``TraceConfig.rounding`` does not apply);
    guided: ``sglang_kvfp4.guided_quantize`` toward a record. Rows need a last dim that is a multiple of 16.
    Reference implementation only (no Triton path). ``ste_clip``: as ``Quantizer.ste_clip``.
    """

    ste_clip: bool = False
    fmt = NAME
    per_row = False
    rounding = "ties_away"

    @property
    def format(self):
        return FORMAT

    @property
    def block_size(self) -> int:
        return BLOCK

    def quantize(self, x: torch.Tensor, *, global_amax=None, generator=None) -> FP4Tensor:
        if global_amax is not None:
            raise ValueError(f"{self.fmt} has no global amax: pass global_amax=None")
        return quantize(x, compute_dtype=torch.float32)

    def guided_quantize(self, x: torch.Tensor, guidance: FullGuidance | CompactGuidance) -> FP4Tensor:
        return guided_quantize(x, guidance)

    def quantize_with_clip_mask(self, x: torch.Tensor, *, guidance=None, global_amax=None
                                ) -> tuple[FP4Tensor, torch.Tensor]:
        """As ``Quantizer.quantize_with_clip_mask``: the FP4 rows and the mask |x / s| <= 6 (x's shape)."""
        q = self.quantize(x, global_amax=global_amax) if guidance is None else self.guided_quantize(x, guidance)
        z = FORMAT.scale_values(block.to_blocks(x, BLOCK), q.block_scales, None)
        return q, clip_mask(z, x.shape[-1])

    def fake_quantize(self, x: torch.Tensor, *, guidance=None, global_amax=None, generator=None) -> torch.Tensor:
        """Quantize-dequantize ``x`` (guided if ``guidance`` is given) with a straight-through gradient."""
        if global_amax is not None:
            raise ValueError(f"{self.fmt} has no global amax: pass global_amax=None")
        return _SGLangKVFakeQuant.apply(x, self, guidance, None, None)


class _SGLangKVFakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, quantizer: SGLangKVQuantizer, guidance, _unused1, _unused2):
        q, inside = quantizer.quantize_with_clip_mask(x.detach(), guidance=guidance)
        ctx.ste_clip = quantizer.ste_clip
        if quantizer.ste_clip:
            ctx.save_for_backward(inside)
        return q.dequantize(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ste_backward(ctx, grad)
