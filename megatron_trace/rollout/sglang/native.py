"""Blackwell (capability >= 10): SGLang's native NVFP4 MoE, and the record of its activation quantize op.

UNVERIFIED: nothing here has run (SGLang's kernels need a Blackwell GPU with torch 2.9.1; neither
exists on the machines of this project). Written against SGLang 0.5.10.post1's sources:

  * ``ModelOptNvFp4FusedMoEMethod.apply`` (srt/layers/quantization/modelopt_quant.py) runs
    ``cutlass_moe_fp4`` (srt/layers/moe/cutlass_moe.py) or FlashInfer's fused MoE; both quantize
    the fc1 input inside the kernel call with the STATIC per-expert global scale
    ``layer.w13_input_scale_quant`` (= 448 * 6 / input_amax, from the checkpoint's ``input_scale``),
    not a per-row amax as the emulated path and the trainer do;
  * their internal quantized activations are not returned. ``record_fc1_input`` therefore calls the
    same NVFP4 quantize op, ``sglang.jit_kernel.nvfp4.scaled_fp4_quant(x, global_scale)`` ->
    (packed uint8 [m, k/2], swizzled float8_e4m3fn scales [round_up(m, 128), round_up(k/16, 4)]),
    on the same input and global scale, un-swizzles the scales (the inverse of
    ``quantization.utils.swizzle_blockscale``: (M/128, 4, 32, K/4, 4) permuted (0, 3, 2, 1, 4)) and
    records an NVFP4 tensor with ``global_amax = input_amax`` (per tensor). Assumed, not verified:
    that this op and ``scaled_fp4_experts_quant`` (used inside ``cutlass_moe_fp4``) produce the same
    bytes per row (they share SGLang's NVFP4 conversion code), and that its packing puts element 2i
    in the low nibble (as ``torch.float4_e2m1fn_x2``);
  * activations are thus quantized with a static per-tensor scale: ``SGLangRolloutBackend.recipe``
    reports ``activation_amax="static_input_scale"`` on this path, so a per-row trainer's recipe check
    fails loudly (the trainer has no static-input-scale mode yet);
  * fc1 input is recorded only when every local expert has the same input scale (one row per token;
    ``export.modelopt`` with one float ``input_amax`` writes that). The fc2 input is quantized inside
    ``cutlass_moe_fp4`` after the activation and is not recorded on this path (the trainer falls
    back there, counted as missing).
"""

from __future__ import annotations

import logging

import torch

from ...formats import FP4Tensor
from ...formats.constants import E2M1_MAX, E4M3_MAX

logger = logging.getLogger(__name__)

NATIVE_MIN_CAPABILITY = 10


def device_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without CUDA (the one device query)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def native_fp4_available() -> bool:
    """True on CUDA devices of compute capability >= 10 (FP4 tensor cores): SGLang's native kernels."""
    cap = device_capability()
    return cap is not None and cap[0] >= NATIVE_MIN_CAPABILITY


def unswizzle_scales(swizzled: torch.Tensor, m: int, k_blocks: int) -> torch.Tensor:
    """SGLang's 128x4-interleaved block scales [round_up(m,128), round_up(kb,4)] -> row-major [m, kb]."""
    mp, kp = -(-m // 128) * 128, -(-k_blocks // 4) * 4
    s = swizzled.reshape(-1).view(torch.uint8)
    if s.numel() != mp * kp:
        raise ValueError(f"swizzled scales hold {s.numel()} bytes, expected {mp}x{kp} for m={m}, k/16={k_blocks}")
    s = s.reshape(mp // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, kp)
    return s[:m, :k_blocks].contiguous().view(torch.float8_e4m3fn)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major e4m3 [m, kb] -> the 128x4 interleaved layout (zero padded), flattened [mp, kp]."""
    m, kb = scales.shape
    mp, kp = -(-m // 128) * 128, -(-kb // 4) * 4
    padded = torch.zeros(mp, kp, dtype=torch.uint8, device=scales.device)
    padded[:m, :kb] = scales.view(torch.uint8)
    return padded.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, kp).view(torch.float8_e4m3fn)


def static_input_amax(layer) -> torch.Tensor | None:
    """The one input amax of all local experts (float32 []) from ``w13_input_scale_quant``, or None."""
    gs = getattr(layer, "w13_input_scale_quant", None)
    if gs is None:
        return None
    gs = gs.float().reshape(-1)
    if bool((gs != gs[0]).any()):
        return None  # per-expert scales: a token's fc1 row would differ per expert
    return (E4M3_MAX * E2M1_MAX) / gs[0]


def fp4_from_op(packed: torch.Tensor, swizzled: torch.Tensor, global_amax: torch.Tensor, k: int) -> FP4Tensor:
    """The NVFP4 op's outputs for x [m, k] as our FP4Tensor (per-tensor global amax)."""
    m = packed.shape[0]
    scales = unswizzle_scales(swizzled, m, k // 16)
    return FP4Tensor(codes=packed.view(torch.uint8), block_scales=scales, global_amax=global_amax.float().reshape(()),
                     shape=(m, k), fmt="nvfp4")


AMAX_ATTR = "trace_fc1_input_amax"


def prepare_layer(layer) -> None:
    """After SGLang's ``process_weights_after_loading``: keep the static input amax (or None) on the layer,
    so the forward needs no host sync to decide."""
    amax = static_input_amax(layer)
    setattr(layer, AMAX_ATTR, amax)
    if amax is None and hasattr(layer, "w13_input_scale_quant"):
        logger.warning("layer %s: per-expert input scales differ; its native fc1 input is not recorded",
                       getattr(layer, "layer_id", "?"))


def record_fc1_input(capture, layer, x: torch.Tensor) -> None:
    """Record what SGLang's NVFP4 quantize op produces for the fc1 input x [T, hidden] (see module doc)."""
    amax = getattr(layer, AMAX_ATTR, None)
    if capture is None or amax is None or not capture.wants(layer.layer_id, "expert_fc1_in"):
        return
    from sglang.jit_kernel.nvfp4 import scaled_fp4_quant

    packed, swizzled = scaled_fp4_quant(x, layer.w13_input_scale_quant.reshape(-1)[:1].float())
    capture.record(layer.layer_id, "expert_fc1_in", fp4_from_op(packed, swizzled, amax, x.shape[-1]))
