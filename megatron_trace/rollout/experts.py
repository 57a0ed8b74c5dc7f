"""Routed experts of the transformers rollout: W4A4 FP4 emulation, routing and guidance capture.

The experts forward is registered with transformers' ``ExpertsInterface`` under
``EXPERTS_IMPLEMENTATION`` (no class is patched). It runs only inside a ``RolloutNumerics``
context (set by ``HFRolloutBackend``), which says what to quantize and where to record.

Numerics (emulation: dequantize, then GEMM in the model dtype):
  expert_fc1_in  one row per token, quantized before the tokens are routed to the experts
  expert_fc2_in  one row per (token, selected expert), in the router's top-k slot order
  weights        each expert's fc1 (= [gate; up], Megatron's ``linear_fc1``) and fc2 matrix with
                 ``TraceConfig.weight_quantizer()`` (per-matrix amax, 1x16 blocks along K); the
                 HF parameters hold the dequantized values, ``ExpertWeightStore`` the codes.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.integrations.moe import ExpertsInterface

from ..formats import FP4Tensor, GuidanceMismatchError, NonFiniteError, Quantizer
from ..formats.block import check_layout
from ..formats.tensor import scales_usable
from ..kernels import Kernel, moe_mma, moe_wgmma, parse_kernel, select_kernel
from .finite import RolloutFiniteChecks
from .fp4_moe import grouped_experts_forward, w4a4_experts_forward
from .recorder import GuidanceRecorder

EXPERTS_IMPLEMENTATION = "megatron_trace_rollout"
FC1, FC2 = "fc1", "fc2"
PREFILL_WGMMA = False
"""Expert calls from 64 routed rows per expert on average (``moe_wgmma.preferred``) up to ``DENSE_FROM_WGMMA`` run the
wgmma GEMM on a second packed copy of the layer's FP4 experts (``ExpertWeightStore.packed(..., layout="wgmma")``).
That copy is one more FP4 payload per layer (about 0.56 bytes per expert parameter in NVFP4), kept until the layer's
weights change, which is why this is off by default. On one H200 a Qwen3-30B-A3B-shaped layer's experts forward runs
1.03-1.11x faster than on the dequantized weights (``DENSE_FROM``) at 64-128 tokens per expert, as fast at 160-256,
and 0.96-0.97x at 512-1024 (BENCHMARKS.md, session 29)."""
DENSE_FROM = 80
"""From this many routed rows per expert on average (``DENSE_FROM_WGMMA`` where ``PREFILL_WGMMA`` is on), the FP4
experts' two GEMMs read the layer's dequantized weights, which the module's parameters hold (``ExpertWeightStore.set``
writes them), with ``torch._grouped_mm`` instead of the FP4 codes. The arithmetic is the emulation's: the exact FP4
weight values in the model dtype, the same activation quantization and records. Hopper has no FP4 tensor cores, so
at prefill sizes the FP4 kernels' dequantization costs more than the weight bytes they save (BENCHMARKS.md, session
29). None: never."""
DENSE_FROM_WGMMA = 256


def _dense_gemms(rows: int, num_experts: int) -> bool:
    """Whether ``rows`` routed rows over ``num_experts`` experts run on the dequantized weights (``DENSE_FROM``)."""
    start = DENSE_FROM_WGMMA if PREFILL_WGMMA else DENSE_FROM
    return start is not None and rows >= start * max(num_experts, 1)


@dataclass
class RolloutNumerics:
    """What the experts forward and the FP4 KV cache need while the model runs."""

    layer_of: dict[int, int]
    """id(experts module) -> layer id (from 0)."""
    activation_quantizer: Quantizer | None = None
    quantize_fc1: bool = False
    quantize_fc2: bool = False
    recorder: GuidanceRecorder | None = None
    bf16_layers: frozenset[int] = frozenset()
    """Layers whose routed experts ``TraceConfig.exclude_modules`` keeps in the model dtype."""
    kernel: str = "reference"
    """``TraceConfig.kernel``: "auto"/"triton" take ``grouped_experts_forward`` for bf16 CUDA tensors (elsewhere
    "auto" takes the reference path and "triton" raises)."""
    weight_store: ExpertWeightStore | None = None
    """FP4 expert weights (the grouped GPU path reads them packed); None: the module's parameters."""
    compiled: bool = False
    """The grouped GPU path's routing and row plumbing as Inductor kernels (``HFRolloutBackend(compile=True)``)."""
    finite: RolloutFiniteChecks | None = None
    """The NaN/Inf counters of the activation sites (``rollout.finite``); None: unchecked on the Triton path."""


def _fast_path(num: RolloutNumerics, hidden: torch.Tensor) -> bool:
    """Whether the grouped GPU path runs (CUDA, bf16, Triton selected, RNE activations). ``kernel="triton"``
    raises where it cannot (``kernels.select_kernel``); "auto" takes the reference path there."""
    if parse_kernel(num.kernel) is Kernel.REFERENCE:
        return False
    q = num.activation_quantizer
    unsupported = None
    if hidden.dtype != torch.bfloat16:
        unsupported = f"the grouped experts path runs bf16 hidden states, not {hidden.dtype}"
    elif q is not None and q.rounding != "rne":
        unsupported = "stochastic rounding has no Triton path"
    try:
        return select_kernel(num.kernel, hidden.device, unsupported=unsupported) is Kernel.TRITON
    except (ValueError, RuntimeError) as err:
        raise type(err)(f"{err} (routed experts, {hidden.dtype} hidden states on {hidden.device}: kernel='triton' "
                        "needs bf16 CUDA tensors and RNE activations; kernel='auto' takes the reference path "
                        "elsewhere)") from None


_ACTIVE: contextvars.ContextVar[RolloutNumerics | None] = contextvars.ContextVar("rollout_numerics", default=None)


@contextmanager
def active_numerics(numerics: RolloutNumerics) -> Iterator[RolloutNumerics]:
    token = _ACTIVE.set(numerics)
    try:
        yield numerics
    finally:
        _ACTIVE.reset(token)


@torch.compiler.disable  # eager inside compiled layers (HFRolloutBackend(compile="layers")): Triton, the recorder
def rollout_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """hidden_states [T, H], top_k_index int [T, k], top_k_weights [T, k] -> [T, H].

    The arithmetic is ``fp4_moe.w4a4_experts_forward`` (shared with the SGLang backend) on the
    module's (dequantized) weights; this wrapper adds the routing and guidance recording.
    """
    num = _ACTIVE.get()
    if num is None:
        raise RuntimeError(
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r} runs only inside an active RolloutNumerics "
            "(HFRolloutBackend.generate or HFRolloutBackend.forward_context())"
        )
    layer = num.layer_of[id(self)]
    fp4 = layer not in num.bf16_layers
    rec = num.recorder
    forward, fc1, fc2, extra = w4a4_experts_forward, self.gate_up_proj, self.down_proj, {}
    if _fast_path(num, hidden_states):
        forward, extra = grouped_experts_forward, {"compiled": num.compiled}
        rows = hidden_states.shape[0] * top_k_index.shape[1]
        if fp4 and num.weight_store is not None and not _dense_gemms(rows, fc1.shape[0]):
            fc1, fc2 = num.weight_store.stacked(layer, FC1), num.weight_store.stacked(layer, FC2)
            layout = _packed_layout(rows, fc1, num.weight_store, layer)
            if layout:  # (the CUDA GEMMs read their own layouts)
                extra.update(packed_fc1=num.weight_store.packed(layer, FC1, layout),
                             packed_fc2=num.weight_store.packed(layer, FC2, layout))
        if rec is not None and rec.compact:  # the quantize pass writes the compact records too
            extra.update(record_fc1=rec.wants(layer, "expert_fc1_in"), record_fc2=rec.wants(layer, "expert_fc2_in"))
    if num.finite is not None and fp4:
        extra.update(check_fc1=num.finite.counter(layer, "expert_fc1_in") if num.quantize_fc1 else None,
                     check_fc2=num.finite.counter(layer, "expert_fc2_in") if num.quantize_fc2 else None)
    res = forward(
        hidden_states, top_k_index, top_k_weights, fc1, fc2,
        activation_quantizer=num.activation_quantizer, quantize_fc1=num.quantize_fc1 and fp4,
        quantize_fc2=num.quantize_fc2 and fp4, apply_gate=self._apply_gate, **extra,
    )
    if rec is not None:
        rec.add_routing(layer, top_k_index)
        if res.fc1_in is not None:
            rec.add_rows(layer, "expert_fc1_in", res.fc1_in, res.fc1_record)
        if res.fc2_in is not None:
            rec.add_rows(layer, "expert_fc2_in", res.fc2_in, res.fc2_record)
    return res.out


def _packed_layout(rows: int, fc1: FP4Tensor, store: ExpertWeightStore, layer: int) -> str | None:
    """The packed layout the experts forward passes for ``rows`` routed rows: "wgmma" at prefill sizes where
    ``PREFILL_WGMMA`` is on and both matrices have that layout, else "mma" where ``moe_mma.AUTO`` is on, else None."""
    if (PREFILL_WGMMA and moe_wgmma.AUTO and moe_wgmma.preferred(rows, fc1)
            and store.packed(layer, FC1, "wgmma") is not None and store.packed(layer, FC2, "wgmma") is not None):
        return "wgmma"
    return "mma" if moe_mma.AUTO else None


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, rollout_experts_forward)


PACKED_LAYOUTS = ("mma", "wgmma")


class ExpertWeightStore:
    """The rollout's FP4 routed-expert weights: one ``FP4Tensor`` per (layer, expert, fc1|fc2).

    fc1 is [2*ffn, hidden] (gate rows then up rows), fc2 is [hidden, ffn]. Whenever an entry
    changes, its dequantized values (model dtype) are written into the HF parameter slice that
    the experts forward reads.
    """

    def __init__(self, quantizer: Quantizer):
        self.quantizer = quantizer
        self._w: dict[tuple[int, int, str], FP4Tensor] = {}
        self._stacked: dict[tuple[int, str], FP4Tensor] = {}
        self._packed: dict[tuple[int, str, str], moe_mma.PackedWeight | None] = {}

    @staticmethod
    def _param_slice(experts, expert: int, which: str) -> torch.Tensor:
        return (experts.gate_up_proj if which == FC1 else experts.down_proj)[expert]

    def quantize_from_params(self, experts, layer: int, expert: int, which: str) -> None:
        """Quantize the current parameter values (model dtype) and replace them by the decoded values. NaN/Inf
        values raise ``NonFiniteError`` naming the weight (the reference quantizer checks in the call)."""
        w = self._param_slice(experts, expert, which)
        try:
            q = self.quantizer.quantize(w.detach())
        except NonFiniteError as err:
            raise NonFiniteError(f"FP4 weight for layer {layer} expert {expert} {which}: {err}") from err
        self.set(experts, layer, expert, which, q)

    def check(self, experts, layer: int, expert: int, which: str, q: FP4Tensor) -> None:
        """What ``set`` checks, without changing anything: shape, format, dtypes, the shapes of codes, scales and amax,
        finite scales and amax of a kind some quantizer writes (``formats.tensor.scales_usable``)."""
        param = self._param_slice(experts, expert, which)
        if tuple(q.shape) != tuple(param.shape):
            raise ValueError(f"FP4 weight for layer {layer} expert {expert} {which} has shape {q.shape}, "
                             f"the model expects {tuple(param.shape)}")
        if q.fmt != self.quantizer.fmt:
            raise ValueError(f"FP4 weight format {q.fmt!r} != the rollout's weight format {self.quantizer.fmt!r}")
        scale_dtype = self.quantizer.format.scale_dtype  # (other dtypes would dequantize to other values, silently)
        if q.codes.dtype != torch.uint8 or q.block_scales.dtype != scale_dtype:
            raise ValueError(f"FP4 weight for layer {layer} expert {expert} {which} has codes {q.codes.dtype} and "
                             f"block scales {q.block_scales.dtype}; {q.fmt} needs torch.uint8 and {scale_dtype}")
        try:  # codes, scales and amax of other shapes would broadcast into the parameter, silently
            check_layout(self.quantizer.format, param, q.codes, 2, q, what="its")
        except GuidanceMismatchError as err:
            raise ValueError(f"FP4 weight for layer {layer} expert {expert} {which}: {err}") from err
        for name, t in (("block scales", q.block_scales), ("global amax", q.global_amax)):
            if t is not None and not bool(torch.isfinite(t.float()).all()):
                raise NonFiniteError(f"FP4 weight for layer {layer} expert {expert} {which}: its {name} hold NaN/Inf")
        bad = ~scales_usable(q.block_scales, q.global_amax)  # (a negative scale flipped the rows' signs, silently)
        if bool(bad.any()):
            rows = bad.nonzero().flatten()[:4].tolist()
            raise ValueError(f"FP4 weight for layer {layer} expert {expert} {which}: rows {rows} have a negative "
                             "block scale or amax, or scales no quantizer writes (an amax of 0 beside a nonzero block "
                             "scale, an E8M0 scale of 2**127)")

    def set(self, experts, layer: int, expert: int, which: str, q: FP4Tensor) -> None:
        self.check(experts, layer, expert, which, q)
        param = self._param_slice(experts, expert, which)
        with torch.no_grad():
            param.copy_(q.dequantize(param.dtype))
        own = lambda t: None if t is None else t.detach().contiguous().clone()  # noqa: E731
        # a copy: the caller's tensors may be views of a receive buffer that the next bucket overwrites
        self._w[(layer, expert, which)] = FP4Tensor(codes=own(q.codes), block_scales=own(q.block_scales),
                                                    global_amax=own(q.global_amax), shape=tuple(q.shape), fmt=q.fmt)
        self._stacked.pop((layer, which), None)
        for layout in PACKED_LAYOUTS:
            self._packed.pop((layer, which, layout), None)

    def stacked(self, layer: int, which: str) -> FP4Tensor:
        """All experts of a layer as one FP4Tensor [E, N, K] (global amax [E, N, 1] per row; cached until a
        ``set`` of that layer): the layout of ``kernels.fp4_grouped_mm``."""
        key = (layer, which)
        if key not in self._stacked:
            experts = sorted(e for (lay, e, w) in self._w if lay == layer and w == which)
            if experts != list(range(len(experts))) or not experts:
                raise KeyError(f"layer {layer} {which!r}: FP4 weights of experts {experts} are not 0..E-1")
            qs = [self._w[(layer, e, which)] for e in experts]
            n = qs[0].shape[0]
            amax = None
            if qs[0].global_amax is not None:  # [] or [N, 1] per expert -> [E, N, 1]
                amax = torch.stack([q.global_amax.float().reshape(-1, 1).expand(n, 1) for q in qs]).contiguous()
            self._stacked[key] = FP4Tensor(
                codes=torch.stack([q.codes for q in qs]),
                block_scales=torch.stack([q.block_scales.view(torch.uint8) for q in qs]).view(qs[0].block_scales.dtype),
                global_amax=amax, shape=(len(qs), *qs[0].shape), fmt=qs[0].fmt)
        return self._stacked[key]

    def packed(self, layer: int, which: str, layout: str = "mma") -> moe_mma.PackedWeight | None:
        """``stacked(layer, which)`` in a CUDA GEMM's layout: "mma" (``kernels.moe_mma.pack``, the decode GEMM) or
        "wgmma" (``kernels.moe_wgmma.pack``, the prefill GEMM). Each is one more copy of the layer's FP4 payload,
        cached the same way. None where the shape has no such layout (N not a multiple of 32 / 128, or K of 256)."""
        if layout not in PACKED_LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {PACKED_LAYOUTS}")
        key = (layer, which, layout)
        if key not in self._packed:
            w = self.stacked(layer, which)
            _, n, k = w.shape
            rows = 32 if layout == "mma" else moe_wgmma.ROWS_PER_CTA
            ok = n % rows == 0 and k % 256 == 0
            self._packed[key] = ((moe_mma.pack if layout == "mma" else moe_wgmma.pack)(w) if ok else None)
        return self._packed[key]

    def get(self, layer: int, expert: int, which: str) -> FP4Tensor:
        try:
            return self._w[(layer, expert, which)]
        except KeyError:
            raise KeyError(f"no FP4 weight for layer={layer} expert={expert} {which!r} (valid: fc1, fc2 of routed "
                           "experts, FP4 mode with the 'weights' site)") from None

    def __len__(self) -> int:
        return len(self._w)

    def nbytes(self) -> int:
        """Bytes of the stored codes, block scales and global amaxes."""
        return sum(fp4_nbytes(q) for q in self._w.values())


def fp4_nbytes(q: FP4Tensor) -> int:
    """Bytes of an FP4 tensor's payload: packed codes + block scales + global amax."""
    n = q.codes.numel() * q.codes.element_size() + q.block_scales.numel() * q.block_scales.element_size()
    if q.global_amax is not None:
        n += q.global_amax.numel() * q.global_amax.element_size()
    return n
