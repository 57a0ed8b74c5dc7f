"""KV-cache site: K and V fake-quantized per token per KV head, blocks of 16 (NVFP4) along head_dim.

Core attention receives K and V after RoPE, [S, B, kv_heads_local, head_dim] (before GQA
repetition), i.e. exactly what the rollout's FP4 KV cache stores. ``TraceKVCore`` quantizes them
(guided on selected layers) and hands them to Megatron's own attention; ``TraceDotProductAttention``
is the local (unfused) variant, the TE variant lives in ``te.py``.

``TraceConfig.kv_format="sglang_kvfp4"``: K/V in SGLang's FP4 KV-cache format instead (``kv_quantizer()``:
E8M0 ceil scales per 16, ties away from zero), so the trainer computes the K/V an SGLang rollout stores and
SGLang's KV records guide it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from ..config import KV_SITES, TraceConfig
from ..formats import FP4Tensor, Quantizer
from ..manifest import kv_cache_name, module_excluded
from .microbatch import check_replayed
from .rows import RowGuidance, map_record
from .sites import finite_checks, quantize_rows, quantize_rows_recorded
from .step import (
    INVALID,
    NOT_GUIDED,
    SHAPE,
    CheckedSite,
    GuidanceFallbackError,
    StepState,
    counted_total,
    counted_valid,
    site_on,
    site_pinned,
)


class KVStep:
    """TRACE state of one attention layer for one step."""

    def __init__(self, state: StepState, layer: int, sites: dict[str, CheckedSite], first_head: int):
        self.state, self.layer, self.sites = state, layer, sites
        self.first_head = first_head  # the model's index of this rank's first KV head (``TraceKVCore.kv_heads``)
        self._host: dict[str, CheckedSite] | None = None  # the sites as given, while held (``hold``)

    def hold(self, device) -> None:
        """This micro-batch's records on ``device`` for its forward or recompute pass (``MicroBatchQueue``)."""
        if self._host is None:
            self._host = self.sites
            self.sites = {site: site_on(c, device) for site, c in self.sites.items()}

    def pin(self) -> None:
        """The host records in pinned memory, once, before the step is first held (``MicroBatchQueue``)."""
        self.sites = {site: site_pinned(c) for site, c in self.sites.items()}

    def release(self) -> None:
        """Back to the host records (the device copies dropped)."""
        if self._host is not None:
            self.sites, self._host = self._host, None

    def rows(self, site: str, x: torch.Tensor) -> RowGuidance | None:
        """Guidance for the rows of x [S, B, g, hd] (g local KV heads), counted per token."""
        st = self.state
        if site not in st.config.guided_sites:
            return None
        S, B, g = x.shape[0], x.shape[1], x.shape[2]
        count = st.counted(B, S, slice(0, S), x.device)
        n = counted_total(count, S * B)
        if not st.is_guided(self.layer, site):
            st.count(self.layer, site, 0, {NOT_GUIDED: n})
            return None
        c = self.sites[site]
        if c.sg is None or tuple(c.sg.record.shape[:2]) != (B, S):
            if c.sg is not None and st.fallback == "fail":
                got = tuple(c.sg.record.shape[:2])
                raise GuidanceFallbackError(f"layer {self.layer} {site}: guidance rows {got} != [B, S]={(B, S)}")
            st.count(self.layer, site, 0, {c.reason or SHAPE: n})
            return None
        if c.all_valid:
            st.count(self.layer, site, n, {INVALID: 0})
        else:
            used = counted_valid(c.sg.valid.to(x.device), count, st.token_index(B, S, slice(0, S), x.device))
            st.count(self.layer, site, used, {INVALID: n - used})
        return self._local_rows(c, S, B, g, x.device)

    def _local_rows(self, c: CheckedSite, S: int, B: int, g: int, device) -> RowGuidance:
        """The rows of x [S, B, g, hd] in its order (token-major, then this rank's g KV heads): one gather each."""
        r = c.sg.record
        heads, local, whole = r.shape[2], slice(self.first_head, self.first_head + g), slice(0, S)
        row = self.state.token_index(B, S, whole, device, heads, local)
        gather = lambda t: t.to(device).reshape(B * S * heads, *t.shape[3:]).index_select(0, row)  # noqa: E731
        rec = map_record(r, gather, (row.numel(), r.shape[-1]))
        if c.all_valid:
            return RowGuidance(rec, self.state.all_valid_flags(row.numel(), device), all_valid=True)
        token = self.state.token_index(B, S, whole, device, heads, local, of_token=True)
        return RowGuidance(rec, c.sg.valid.to(device).reshape(-1).index_select(0, token))


class TraceKVCore:
    """Quantizes K and V before Megatron's attention; shared by the local and TE attentions."""

    trace_config: TraceConfig
    _trace_step = None  # KVStep while a trace_guidance context is open

    def _init_trace(self, trace_config: TraceConfig) -> None:
        if not isinstance(trace_config, TraceConfig):
            raise TypeError(f"trace_config must be a TraceConfig, got {type(trace_config).__name__}")
        self.trace_config = trace_config
        self._kv_q = trace_config.kv_quantizer()  # activation quantizer, or SGLang's KV format (kv_format)
        # SGLang's KV format has no Triton path: its fake-quant always runs the reference
        self._kv_kernel = trace_config.kernel if isinstance(self._kv_q, Quantizer) else "reference"
        if not isinstance(self._kv_q, Quantizer) and self.config.kv_channels % self._kv_q.block_size:
            raise ValueError(f"TraceConfig.kv_format={trace_config.kv_format!r} needs kv_channels (head_dim) to be a "
                             f"multiple of {self._kv_q.block_size}, got {self.config.kv_channels}")
        # layer_number counts from 1 across pipeline stages; exclude_modules keeps this layer's K/V in BF16
        self._excluded = module_excluded(trace_config, kv_cache_name(self.layer_number - 1))
        tp = self.config.tensor_model_parallel_size or 1
        if tp > 1 and isinstance(self._kv_q, Quantizer) and self._kv_q.fmt == "nvfp4" and not self._kv_q.per_row \
                and any(map(self.trace_quantizes, KV_SITES)):
            raise ValueError(f"activation_amax='per_tensor' at the KV sites with tensor_model_parallel_size={tp}: a "
                             "rank holds only its KV heads, so one amax over them would depend on the TP size (use "
                             "activation_amax='per_row', the default, or TP 1)")
        self._finite = finite_checks(trace_config, f"layer {self.layer_number - 1}", KV_SITES)

    def trace_quantizes(self, site: str) -> bool:
        """Whether this layer quantizes ``site`` (the config, less ``exclude_modules``)."""
        return not self._excluded and self.trace_config.quantizes(site)

    trace_kv_groups: int | None = None  # the model's KV heads, told by find_trace_layers (see ``kv_heads``)

    def kv_heads(self) -> tuple[int, int]:
        """(the model's KV heads G, the index of this rank's first one). Megatron hands core attention a config
        with num_query_groups = TP size when G < TP (each KV head then replicated on TP / G ranks), so G comes
        from the attention module (``find_trace_layers``); rank r holds heads from r * G // TP."""
        group = getattr(self, "tp_group", None) or getattr(self, "_tp_group", None)  # local / TE attention
        if group is None:
            raise ValueError(f"{type(self).__name__} has no tensor-parallel group")
        heads = self.trace_kv_groups or self.config.num_query_groups or self.config.num_attention_heads
        return heads, group.rank() * heads // group.size()

    def quantize_kv(self, site: str, x: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        """x [S, B, g, hd] -> fake-quantized, one row per (token, KV head). Packed sequences
        (``packed_seq_params.qkv_format == "thd"``: Megatron hands TE's attention K/V as [T, g, hd]) are taken as
        [T, 1, g, hd], the layout ``packing.pack_step`` gives the guidance."""
        if not self.trace_quantizes(site):
            return x
        step = self._trace_step
        if step is None:
            check_replayed(self)
        elif x.dim() == 3 and getattr(packed_seq_params, "qkv_format", None) == "thd":
            cp = self.config.context_parallel_size or 1
            if cp > 1:  # (each rank holds 2 * cp chunks of every sample: no contiguous [1, T] rows)
                raise ValueError(f"packed sequences (qkv_format='thd') with context_parallel_size={cp} under "
                                 "trace_guidance are not supported (context parallelism 1 only)")
            return self.quantize_kv(site, x.unsqueeze(1)).view(x.shape)
        elif x.dim() != 4:
            fmt = getattr(packed_seq_params, "qkv_format", None)
            raise ValueError(f"the KV site under trace_guidance needs K/V as [S, B, heads, head_dim], or [T, heads, "
                             f"head_dim] with packed_seq_params.qkv_format='thd', got {tuple(x.shape)} with "
                             f"qkv_format={fmt!r}")
        rows = step.rows(site, x) if step is not None else None
        flat = x.reshape(-1, x.shape[-1])
        if step is not None and step.state.recorder is not None:
            y, q = quantize_rows_recorded(self._kv_q, flat, rows)
            step.state.recorder.add_kv(step.layer, site, _reshape(q, x.shape))
        else:
            y = quantize_rows(self._kv_q, flat, rows, kernel=self._kv_kernel, check_finite=self._finite[site])
        return y.view(x.shape)


def _reshape(q: FP4Tensor, shape) -> FP4Tensor:
    lead = tuple(shape[:-1])
    rs = lambda t: t.reshape(*lead, *t.shape[1:])  # noqa: E731
    amax = None if q.global_amax is None else (q.global_amax if q.global_amax.dim() == 0 else rs(q.global_amax))
    return FP4Tensor(codes=rs(q.codes), block_scales=rs(q.block_scales), global_amax=amax, shape=tuple(shape),
                     fmt=q.fmt)


class TraceDotProductAttention(TraceKVCore, DotProductAttention):
    """Megatron's local DotProductAttention with the KV site (``kv_k``, ``kv_v``)."""

    def __init__(self, *args, trace_config: TraceConfig, **kwargs):
        DotProductAttention.__init__(self, *args, **kwargs)
        self._init_trace(trace_config)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        key = self.quantize_kv("kv_k", key, packed_seq_params)
        value = self.quantize_kv("kv_v", value, packed_seq_params)
        return DotProductAttention.forward(
            self, query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
