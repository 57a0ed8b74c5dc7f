"""The W4A4-emulated routed-expert computation shared by every rollout backend (one function).

``w4a4_experts_forward`` is the numerics of the hf backend's experts forward
(``rollout.experts.rollout_experts_forward``), written as a pure function so that SGLang's TRACE
MoE method (``rollout.sglang.quant``) runs the very same operations in the same order:

  1. expert_fc1_in: quantize the [T, H] hidden rows once (activation quantizer, RNE), dequantize
     in fp32, cast once to the model dtype;
  2. sort the (token, slot) pairs by expert (stable), fc1 GEMM per expert in the model dtype
     against the dequantized [2F, H] weight ([gate; up], Megatron's ``linear_fc1``);
  3. gate: ``act(gate) * up`` in the model dtype;
  4. expert_fc2_in: quantize the [T, k, F] rows (one per token and slot), dequantize;
  5. fc2 GEMM per expert, weight by the router's top-k weights, sum over k in the model dtype.

Weights are given either dequantized ([E, N, K] in the model dtype, as the hf backend stores them)
or packed (``PackedExperts``: codes + block scales + exact global amax, as SGLang stores them);
packed experts are dequantized per expert with ``FP4Tensor.dequantize`` (fp32, cast once), so both
give the same values bit for bit.

``grouped_experts_forward`` is the hf backend's GPU path of the same numerics (``TraceConfig.kernel``
auto/triton on CUDA, bf16): Triton activation quantize+dequantize (the reference's codes and values), then one
grouped GEMM per matrix kind (packed FP4 weights: the Triton W4A16 kernel; dense: ``torch._grouped_mm``),
equal to the emulation within bf16 rounding, with no host sync (CUDA-graph capturable).

``check_fc1`` / ``check_fc2`` (``rollout.finite``): the site's ``FiniteCounter``. The Triton quantize counts NaN/Inf
inputs into it on the device (and keeps them NaN/Inf in the dequantized rows); the reference quantize raises
``NonFiniteError`` in the call, re-raised naming the counter's layer and site. None: the Triton quantize does not
check (finite garbage for NaN/Inf, see ``rollout.finite``), the reference raises naming no site.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import CompactGuidance, FP4Tensor, Quantizer, get_format
from ..kernels.checks import FiniteCounter
from .finite import naming


@dataclass(frozen=True)
class PackedExperts:
    """FP4 weights of ``E`` experts for one matrix kind, as an engine stores them.

    codes         uint8 [E, N, Kp/2]     packed E2M1 (element 2i in the low nibble)
    block_scales  [E, N, Kp/B]           float8_e4m3fn (nvfp4) / float8_e8m0fnu (mxfp4)
    global_amax   float32 [E] (one per expert matrix) or [E, N] (one per output row); None for mxfp4
    k             the unpadded K (input features)

    Dtypes, shapes and the amax's presence are checked here (a wrong one raises naming it).
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_amax: torch.Tensor | None
    k: int
    fmt: str = "nvfp4"

    def __post_init__(self):
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 3:
            raise ValueError(f"PackedExperts.codes must be uint8 [E, N, K/2], got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        e, n = self.codes.shape[:2]
        fmt = get_format(self.fmt)
        block = fmt.block_size
        if self.block_scales.dtype != fmt.scale_dtype:  # (raw scale bytes would decode as integers)
            raise ValueError(f"PackedExperts.block_scales dtype {self.block_scales.dtype} is not {fmt.scale_dtype}, "
                             f"the scale dtype of fmt={self.fmt!r}")
        nb = -(-self.k // block)  # blocks of the unpadded k
        if tuple(self.block_scales.shape) != (e, n, nb) or self.codes.shape[2] * 2 != nb * block:
            raise ValueError(f"PackedExperts.block_scales shape {tuple(self.block_scales.shape)} and codes shape "
                             f"{tuple(self.codes.shape)} do not fit (E, N) = {(e, n)} and k={self.k} ({nb} blocks of "
                             f"{block} for fmt={self.fmt!r})")
        g = self.global_amax
        if self.fmt == "nvfp4" and g is None:
            raise ValueError("PackedExperts.global_amax is None: fmt='nvfp4' needs a float32 [E] or [E, N] amax")
        if self.fmt != "nvfp4" and g is not None:
            raise ValueError(f"PackedExperts.global_amax must be None for fmt={self.fmt!r} (it has no global amax)")
        if g is not None and tuple(g.shape) not in ((e,), (e, n)):
            raise ValueError(f"PackedExperts.global_amax shape {tuple(g.shape)} must be ({e},) or ({e}, {n})")
        if g is not None and g.dtype != torch.float32:
            raise ValueError(f"PackedExperts.global_amax dtype {g.dtype} is not torch.float32")

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    def expert(self, e: int) -> FP4Tensor:
        """Expert ``e``'s matrix as an ``FP4Tensor`` [N, K]."""
        g = self.global_amax
        if g is not None:
            g = g[e] if g.dim() == 1 else g[e].unsqueeze(-1)  # [] or [N, 1]
        n = self.codes.shape[1]
        return FP4Tensor(codes=self.codes[e], block_scales=self.block_scales[e], global_amax=g,
                         shape=(n, self.k), fmt=self.fmt)

    @classmethod
    def stack(cls, tensors: list[FP4Tensor]) -> PackedExperts:
        """Stack per-expert ``FP4Tensor`` [N, K] (all with a per-tensor or all with a per-row amax)."""
        if not tensors:
            raise ValueError("PackedExperts.stack needs at least one FP4Tensor")
        first = tensors[0]
        bad = [i for i, t in enumerate(tensors) if t.shape != first.shape or t.fmt != first.fmt]
        if bad:
            raise ValueError(f"experts {bad} differ in shape/format from expert 0 {first.shape} {first.fmt}")
        shapes = {None if t.global_amax is None else tuple(t.global_amax.shape) for t in tensors}
        if len(shapes) > 1:
            raise ValueError(f"experts' global amaxes have shapes {sorted(map(str, shapes))}: stack experts whose "
                             "amaxes are all per-tensor or all per-row")
        amax = None
        if first.global_amax is not None:
            amax = torch.stack([t.global_amax.reshape(-1) if t.global_amax.dim() else t.global_amax
                                for t in tensors]).float()
        return cls(codes=torch.stack([t.codes for t in tensors]),
                   block_scales=torch.stack([t.block_scales.view(torch.uint8) for t in tensors]).view(
                       first.block_scales.dtype),
                   global_amax=amax, k=first.shape[-1], fmt=first.fmt)


Weights = torch.Tensor | PackedExperts


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2F] -> [.., F]: ``silu(gate) * up`` in the input dtype (transformers' default gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_matrix(w: Weights, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s [N, K] matrix in ``dtype`` (dequantized fp32 -> ``dtype`` when packed)."""
    if isinstance(w, PackedExperts):
        return w.expert(e).dequantize(dtype)
    return w[e].to(dtype)


def _grouped_linear(x: torch.Tensor, w: Weights, counts: list[int]) -> torch.Tensor:
    """x [N, in] sorted by expert, counts per expert -> [N, out] (one GEMM per expert, in x.dtype)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(F.linear(x[start : start + n], expert_matrix(w, e, x.dtype)))
            start += n
    if not outs:
        n_out = w.codes.shape[1] if isinstance(w, PackedExperts) else w.shape[1]
        return x.new_zeros(0, n_out)
    return torch.cat(outs, 0)


@dataclass
class ExpertsOutput:
    out: torch.Tensor
    """[T, H] in the hidden dtype."""
    fc1_in: FP4Tensor | None = None
    """expert_fc1_in rows [T, H] as quantized (None when the site is not quantized)."""
    fc2_in: FP4Tensor | None = None
    """expert_fc2_in rows [T, k, F] as quantized, slots in the router's top-k order."""
    fc1_record: CompactGuidance | None = None
    """The compact record of ``fc1_in``, emitted by the quantize pass (``record_fc1``; GPU path only)."""
    fc2_record: CompactGuidance | None = None
    """The compact record of ``fc2_in`` (``record_fc2``; GPU path only)."""


def w4a4_experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    fc1: Weights,
    fc2: Weights,
    *,
    activation_quantizer: Quantizer | None,
    quantize_fc1: bool = True,
    quantize_fc2: bool = True,
    apply_gate: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    check_fc1: FiniteCounter | None = None,
    check_fc2: FiniteCounter | None = None,
) -> ExpertsOutput:
    """hidden [T, H], top_k_index int [T, k], top_k_weights [T, k]; fc1 [E, 2F, H], fc2 [E, H, F].

    Returns the weighted expert output [T, H] and the quantized activation rows (for guidance).
    ``check_fc1`` / ``check_fc2``: see the module docstring (the reference quantize: NaN/Inf raise naming the site).
    """
    tokens, k = top_k_index.shape
    num_experts = fc1.num_experts if isinstance(fc1, PackedExperts) else fc1.shape[0]
    if tokens and (int(top_k_index.min()) < 0 or int(top_k_index.max()) >= num_experts):
        raise ValueError(f"top_k_index holds expert ids outside [0, {num_experts}): "
                         f"min {int(top_k_index.min())}, max {int(top_k_index.max())}")
    if (quantize_fc1 or quantize_fc2) and activation_quantizer is None:
        raise ValueError("quantize_fc1/quantize_fc2 need an activation_quantizer")
    x = hidden  # [T, H]
    q1 = q2 = None
    if quantize_fc1:
        with naming(check_fc1):
            q1 = activation_quantizer.quantize(x)
        x = q1.dequantize(x.dtype)
    flat = top_k_index.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    h = _grouped_linear(x[order // k], fc1, counts)  # [T*k, 2F] sorted by expert
    h = apply_gate(h)  # [T*k, F]
    act = torch.empty_like(h)
    act[order] = h  # (token, slot) order
    if quantize_fc2:  # (explicit widths: a view of no rows, e.g. an idle rank's, cannot infer a -1)
        with naming(check_fc2):
            q2 = activation_quantizer.quantize(act.view(tokens, k, act.shape[-1]))  # rows: (token, slot)
        act = q2.dequantize(act.dtype).view(tokens * k, act.shape[-1])
    y = _grouped_linear(act[order], fc2, counts)  # [T*k, H]
    out = torch.empty_like(y)
    out[order] = y
    out = out.view(tokens, k, y.shape[-1]) * top_k_weights.unsqueeze(-1).to(out.dtype)
    return ExpertsOutput(out.sum(1).to(hidden.dtype), q1, q2)


def _grouped_dense(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, K] bf16 sorted by expert, w [E, N_out, K] -> [N, N_out] with ``torch._grouped_mm`` (CUDA)."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _quantize_dequantize(x: torch.Tensor, quantizer: Quantizer, record: bool = False,
                         check: FiniteCounter | None = None) -> tuple[FP4Tensor, CompactGuidance | None, torch.Tensor]:
    """One Triton pass: the FP4 rows of x, their compact record (``record``: mantissa bits written by the same
    pass) and their dequantized values in x.dtype (the reference's bits). ``check``: the counter the pass counts
    NaN/Inf inputs into (they stay NaN/Inf in the dequantized values), or None (unchecked)."""
    from ..kernels import fused

    q, rec, out = fused.quantize(x, quantizer, record=record, deq_dtype=x.dtype,
                                 check_finite=False if check is None else check)
    return q, rec, out["deq"].view(x.shape)


def _routing(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top_k_index [T, k] -> (order, offs, inv): the (token, slot) pairs sorted by expert (stable), the cumulative
    tokens per expert (int32 [E], ``torch._grouped_mm``'s offs) and order's inverse permutation. No host sync.

    On CUDA, for inputs that ``kernels.moe_routing_triton.fits`` (decode), one Triton launch with the same result
    bit for bit; elsewhere ``_routing_torch``."""
    if _routing_kernel_fits(top_k_index, num_experts):
        from ..kernels import moe_routing_triton

        return moe_routing_triton.routing(top_k_index, num_experts)
    return _routing_torch(top_k_index, num_experts)


def _routing_kernel_fits(top_k_index: torch.Tensor, num_experts: int) -> bool:
    """Whether ``_routing`` takes the one-launch Triton kernel: CUDA, Triton installed, a small integer [T, k] (a
    host-side decision on shapes and dtypes only)."""
    from ..kernels.dispatch import triton_available

    if not (top_k_index.is_cuda and top_k_index.dim() == 2 and triton_available()):
        return False
    from ..kernels import moe_routing_triton

    return top_k_index.dtype in moe_routing_triton.INDEX_DTYPES and moe_routing_triton.fits(top_k_index.numel(),
                                                                                            num_experts)


def _routing_torch(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_routing`` in PyTorch ops (a sort, a searchsorted, an index_put): any size and device."""
    flat = top_k_index.reshape(-1)  # [T*k]
    key = flat.to(torch.int16) if num_experts <= 1 << 15 else flat  # a 2-byte radix sort: 2 passes, not 8
    ids, order = torch.sort(key, stable=True)  # the same order as int64 keys (stable)
    experts = torch.arange(num_experts, device=flat.device, dtype=ids.dtype)
    offs = torch.searchsorted(ids, experts, right=True).to(torch.int32)  # (bincount would sync)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, offs, inv


def _sorted_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Token rows x [T, H] in expert order: row i is pair order[i]'s token."""
    return x[order // k]


def _gated_rows(h: torch.Tensor, inv: torch.Tensor, apply_gate: Callable) -> torch.Tensor:
    """fc1 outputs in expert order [T*k, 2F] -> gated rows in (token, slot) order [T*k, F]."""
    return apply_gate(h)[inv]


COMBINE_KERNEL = True
"""``_combine`` on CUDA runs the one-launch Triton kernel (False: the PyTorch ops, for A/B)."""


def _combine(y: torch.Tensor, inv: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fc2 outputs in expert order [T*k, H] -> sum over the slots of router weight x output, [T, H] in ``dtype``.

    On CUDA with Triton: one launch (``kernels.moe_combine_triton``) instead of the gather, multiply and sum,
    which write [T, k, H] each; the same bits as ``_combine_torch`` (tests/gpu/test_moe_combine_gpu.py)."""
    from ..kernels.dispatch import triton_available

    if COMBINE_KERNEL and y.is_cuda and triton_available():
        from ..kernels import moe_combine_triton

        return moe_combine_triton.combine(y, inv, top_k_weights, dtype)
    return _combine_torch(y, inv, top_k_weights, dtype)


def _combine_torch(y: torch.Tensor, inv: torch.Tensor, top_k_weights: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """``_combine`` in PyTorch ops: products rounded to y's dtype, the sum over the k slots in fp32, one rounding."""
    tokens, k = top_k_weights.shape
    return (y[inv].view(tokens, k, y.shape[-1]) * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(1).to(dtype)


_EAGER = (_routing, _sorted_rows, _gated_rows, _combine)


@functools.cache
def _compiled_ops() -> tuple[Callable, ...]:
    """``_EAGER`` compiled by Inductor, rounding where the eager functions round (``rollout.compiled``). The routing
    decides outside the compiled code: the Triton kernel where ``_routing`` takes it, else ``_routing_torch``
    compiled."""
    from .compiled import compile_like_eager

    routing_torch = compile_like_eager(_routing_torch)

    def routing(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if _routing_kernel_fits(top_k_index, num_experts):
            return _routing(top_k_index, num_experts)
        return routing_torch(top_k_index, num_experts)

    return (routing, *(compile_like_eager(fn) for fn in (_sorted_rows, _gated_rows, _combine_torch)))


def grouped_experts_forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    fc1: torch.Tensor | FP4Tensor,
    fc2: torch.Tensor | FP4Tensor,
    *,
    activation_quantizer: Quantizer | None,
    quantize_fc1: bool = True,
    quantize_fc2: bool = True,
    apply_gate: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    record_fc1: bool = False,
    record_fc2: bool = False,
    compiled: bool = False,
    packed_fc1=None,
    packed_fc2=None,
    check_fc1: FiniteCounter | None = None,
    check_fc2: FiniteCounter | None = None,
) -> ExpertsOutput:
    """The GPU path of ``w4a4_experts_forward``: one grouped GEMM per matrix kind, no host sync.

    fc1 [E, 2F, H], fc2 [E, H, F]: packed ``FP4Tensor`` (global amax [] or [E, N, 1]; the Triton
    W4A16 kernel ``kernels.fp4_grouped_mm`` dequantizes in registers) or dense bf16 tensors
    (``torch._grouped_mm``). Activations are quantized/dequantized by the Triton twins of ``formats``
    (same codes and values as the reference). The GEMMs accumulate in fp32 with the exact FP4 weight
    values, so outputs equal the reference's within bf16 rounding, not bit for bit. Expert ids are not
    range-checked (that would sync); CUDA, bf16 hidden only. No host sync: capturable in a CUDA graph.
    ``record_fc1`` / ``record_fc2``: the quantize pass of that site also writes its compact guidance record.
    The routing (``_routing``) is one Triton launch at decode sizes (``kernels.moe_routing_triton``).
    ``compiled``: the routing, row permutations, gate and weighted sum around the GEMMs (about fifteen small
    kernels per layer in eager PyTorch) run through Inductor, rounding where the eager functions round.
    ``packed_fc1`` / ``packed_fc2``: the FP4 weights in ``kernels.moe_mma.pack``'s layout too, for the CUDA GEMM
    where ``fp4_grouped_mm`` picks it (``moe_mma.AUTO``).
    ``check_fc1`` / ``check_fc2``: the sites' NaN/Inf counters (see the module docstring; no host sync).
    """
    from ..kernels import fp4_grouped_mm

    routing, sorted_rows, gated_rows, combine = _compiled_ops() if compiled else _EAGER
    tokens, k = top_k_index.shape
    x = hidden  # [T, H]
    q1 = q2 = r1 = r2 = None
    if quantize_fc1:
        q1, r1, x = _quantize_dequantize(x, activation_quantizer, record_fc1, check_fc1)
    order, offs, inv = routing(top_k_index, fc1.shape[0])

    def gemm(a, w, packed):
        if isinstance(w, FP4Tensor):
            return fp4_grouped_mm(a, w, offs, kernel="triton", packed=packed)
        return _grouped_dense(a, w, offs)

    act = gated_rows(gemm(sorted_rows(x, order, k), fc1, packed_fc1), inv, apply_gate)  # [T*k, F], (token, slot)
    if quantize_fc2:
        f = act.shape[-1]  # (explicit widths: a rank given no tokens views 0 elements)
        q2, r2, act = _quantize_dequantize(act.view(tokens, k, f), activation_quantizer, record_fc2, check_fc2)
        act = act.view(tokens * k, f)
    y = gemm(act[order], fc2, packed_fc2)  # [T*k, H] sorted by expert
    return ExpertsOutput(combine(y, inv, top_k_weights, hidden.dtype), q1, q2, r1, r2)
