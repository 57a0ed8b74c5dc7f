"""FP4 QAT routed experts with Megatron's expert interface (torch variant; the TE variant is in ``te.py``).

Megatron calls ``experts(permuted_local_hidden_states [N, H], tokens_per_expert [E_local],
permuted_probs [N])`` with rows sorted by local expert and expects ``(output [N, H], None)``.

Numerics per row, matching the rollout (SGLang / ``rollout.experts``):

  x  = Q(expert_fc1_in row)                 per-row amax: equal to quantizing before dispatch (per-tensor:
                                            the source rank's pre-dispatch amax travels with the row)
  h  = act(x @ Qw(W1_e).T)                  W1_e = [gate; up] (Megatron's linear_fc1), GLU or not
  h  = Q(expert_fc2_in row)                 one row per (token, expert), before the routing weight
  y  = (h @ Qw(W2_e).T) * prob              the weight is applied after FC2, as the rollout does

``Qw`` fake-quantizes each expert's weight with ``TraceConfig.weight_quantizer()`` (NVFP4 1x16
blocks along K, per-tensor amax, RNE, straight-through gradient): the rollout's codes exactly.
Megatron's own experts multiply the routing weight before FC2; without quantization both are equal in exact arithmetic,
not bit for bit in BF16: experts ``exclude_modules`` keeps unquantized compute the rollout's BF16 order (weight after
FC2), not Megatron's stock SequentialMLP's.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

from ..config import TraceConfig
from ..kernels import fake_quantize
from ..manifest import experts_name, module_excluded
from . import expert_weights
from .gemm import grouped_linear
from .microbatch import check_replayed
from .moe_step import FC1, FC2, ExpertRows
from .sites import finite_checks, quantize_rows, quantize_rows_recorded, relabel
from .weight_reuse import reuse_or_make, weights_key

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}

EARLY_WEIGHTS = True
"""False: the experts' weights are fake-quantized inside the experts' forward only, after the dispatcher's host sync,
even where a MoE layer hook is installed (``bench_qat_step --late-weights``)."""


def check_expert_config(config, trace_config: TraceConfig | None = None) -> None:
    """Reject Megatron options the TRACE experts do not implement (clear errors at build time)."""
    problems = []
    ep = config.expert_model_parallel_size or 1
    if ep > 1 and trace_config is not None and trace_config.format == "nvfp4" and \
            trace_config.activation_amax == "per_tensor" and trace_config.quantizes(FC2):
        problems.append(f"activation_amax='per_tensor' with expert_model_parallel_size={ep}: a rank's FC2 rows are "
                        "spread over the expert-parallel ranks, so one amax over them would depend on the EP size "
                        "(use activation_amax='per_row', the default and batch-invariant, or EP 1)")
    tp = config.tensor_model_parallel_size or 1
    per_tensor = trace_config is not None and trace_config.format == "nvfp4" and \
        trace_config.activation_amax == "per_tensor"
    if tp > 1 and config.sequence_parallel and per_tensor and any(map(trace_config.quantizes, (FC1, FC2))):
        problems.append(f"activation_amax='per_tensor' with tensor_model_parallel_size={tp} and sequence_parallel: a "
                        f"rank's MoE layer holds 1/{tp} of the tokens, so one amax over them would depend on the TP "
                        "size (use activation_amax='per_row', the default and batch-invariant, or TP 1)")
    if getattr(config, "moe_latent_size", None):
        problems.append(f"moe_latent_size={config.moe_latent_size} (the experts would take the latent projection, "
                        "not the hidden state that guidance, recording and the per-tensor amax use at expert_fc1_in)")
    if config.add_bias_linear:
        problems.append("add_bias_linear=True (use --disable-bias-linear)")
    if config.moe_apply_probs_on_input:
        problems.append("moe_apply_probs_on_input=True (the routing weight is applied after FC2)")
    if (config.expert_tensor_parallel_size or 1) > 1:
        problems.append(f"expert_tensor_parallel_size={config.expert_tensor_parallel_size} (supported: 1)")
    if getattr(config, "delay_wgrad_compute", False):
        problems.append("delay_wgrad_compute=True (TE's deferred weight gradient bypasses the fake-quant "
                        "straight-through path)")
    if config.fp8 or config.fp4:
        problems.append("Megatron's own fp8/fp4 recipes (TRACE quantizes the experts itself)")
    problems.extend(_memory_options(config))
    if config.moe_token_dispatcher_type not in _DISPATCHERS:
        kind = config.moe_token_dispatcher_type
        problems.append(f"moe_token_dispatcher_type={kind!r} (supported: allgather, alltoall)")
    if problems:
        raise ValueError("TRACE experts do not support " + "; ".join(problems))
    _check_router_runs()


EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act")
"""Megatron's ``offload_modules`` that its grouped experts implement inside their own forward."""


def _memory_options(config) -> list[str]:
    """Megatron's memory options implemented inside its grouped experts' forward (``GroupedMLP``, ``TEGroupedMLP``),
    which the TRACE experts replace: accepted, they would keep the activations they name in memory, silently."""
    problems = []
    if config.recompute_granularity == "selective" and "moe_act" in (config.recompute_modules or ()):
        problems.append("recompute_modules 'moe_act' (the TRACE experts' forward does not checkpoint the expert "
                        "activation: it would stay in memory; recompute 'moe', the whole MoE layer, instead, or drop "
                        "'moe_act')")
    offload = [m for m in EXPERT_OFFLOAD_MODULES if m in (config.offload_modules or ())]
    if config.fine_grained_activation_offloading and offload:
        problems.append(f"offload_modules {offload} (the TRACE experts' forward does not offload their inputs to "
                        "the CPU: they would stay in device memory; drop them from offload_modules)")
    return problems


def _check_router_runs() -> None:
    """megatron-core 0.16.1's MoE router reads ``moe_utils.te_general_gemm``, defined only when Transformer Engine
    imports: without TE the layer's first forward raises ``NameError`` (TRACE or not). Said at build time instead,
    with the fix (no Megatron code is patched here)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        raise RuntimeError(
            "megatron-core's MoE router reads moe_utils.te_general_gemm, which is defined only when Transformer "
            "Engine imports, and it does not here: the first forward would raise NameError (a megatron-core 0.16.1 "
            "bug, with or without TRACE). Install transformer-engine, or call "
            "megatron_trace.testing.megatron_cpu.fix_router_without_te() before building the model (it defines it "
            "as None: the router then uses torch's matmul)")


class TraceExpertsCore:
    """The part of the TRACE experts shared by the torch and TE variants.

    A variant provides ``_fc1(x, tokens_per_expert)`` and ``_fc2(h, tokens_per_expert)`` (GEMMs
    with fake-quantized weights) and calls ``_init_trace`` after Megatron's constructor.
    """

    trace_config: TraceConfig
    _trace_step = None  # MoEStep while a trace_guidance context is open
    _weight_reuse = None  # dict while a reuse_weight_quant scope is open (``weight_reuse``)
    _prepared = None  # {linear: (weights_key, fake-quantized [E, M, K])} from prepare_weights, for the next forward
    trace_layer: int | None = None  # layer id, told by find_trace_layers (Megatron never tells the experts)

    def _init_trace(self, trace_config: TraceConfig, pg_collection) -> None:
        if not isinstance(trace_config, TraceConfig):
            raise TypeError(f"trace_config must be a TraceConfig, got {type(trace_config).__name__}")
        check_expert_config(self.config, trace_config)
        self.trace_config = trace_config
        self._trace_pg = pg_collection
        self._act_q = trace_config.activation_quantizer()
        self._weight_q = trace_config.weight_quantizer() if trace_config.quantizes("weights") else None
        self._kernel = trace_config.kernel  # fake-quant implementation (kernels.select_kernel)
        self._payload_dispatcher = None
        self._payload_order = None  # the local permutation of the last dispatch_payload (None: dispatcher)
        self._excluded = False if not trace_config.exclude_modules else None  # None: unknown until bound
        self._finite = finite_checks(trace_config, "experts (layer unknown)", (FC1, FC2, "weights"))

    def bind_trace_layer(self, layer: int) -> None:
        """Set the layer id and apply ``TraceConfig.exclude_modules`` (excluded experts run unquantized)."""
        self.trace_layer = layer
        relabel(self._finite, f"layer {layer}")
        self._excluded = module_excluded(self.trace_config, experts_name(layer))
        for linear in (getattr(self, "linear_fc1", None), getattr(self, "linear_fc2", None)):
            if hasattr(linear, "trace_weight_quantizer"):  # TE variant: its linears fetch the weights
                linear.trace_weight_quantizer = None if self._excluded else self._weight_q

    def hook_moe_layer(self, moe) -> None:
        """Install ``prepare_weights`` as a forward pre-hook of ``moe`` (this module's MoE layer) once; a no-op for
        experts that fetch their weights per call (TE)."""

    def trace_quantizes(self, site: str) -> bool:
        """Whether this layer's experts quantize ``site`` (the config, less ``exclude_modules``)."""
        if self._excluded is None:
            raise RuntimeError("TraceConfig.exclude_modules needs the experts' layer ids: call "
                               "megatron_trace.megatron.find_trace_layers(model) once after building the model "
                               "(trace_guidance and the module audit do)")
        return not self._excluded and self.trace_config.quantizes(site)

    # ---- numerics -----------------------------------------------------------------------------
    def quantize_weights(self, w: torch.Tensor) -> torch.Tensor:
        """Stacked expert weights [E, M, K], each with its own per-tensor amax (one quantizer call).

        Bit-identical to quantizing each expert alone: every row of expert e gets e's amax.
        """
        if self._weight_q is None or not self.trace_quantizes("weights"):
            return w
        return fake_quantize(w, self._weight_q, stacked=True, kernel=self._kernel,
                             check_finite=self._finite["weights"])

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if not cfg.gated_linear_unit:
            return cfg.activation_func(h)
        x_glu, x_lin = torch.chunk(h, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_lin = x_lin.clamp(min=-val, max=val)
        return cfg.activation_func(x_glu) * (x_lin + cfg.glu_linear_offset)

    def _site(self, site: str, x: torch.Tensor, rows, amax=None, record: bool = False):
        if not self.trace_quantizes(site):
            return x, None
        if record:
            return quantize_rows_recorded(self._act_q, x, rows, global_amax=amax)
        return quantize_rows(self._act_q, x, rows, global_amax=amax, kernel=self._kernel,
                             check_finite=self._finite[site]), None

    def _trace_forward(self, x: torch.Tensor, tokens_per_expert, probs: torch.Tensor):
        """x [N, H] rows sorted by local expert, probs [N] -> (y [N, H], None)."""
        step = self._trace_step
        if step is None:
            check_replayed(self)
        if step is None and self._trace_pg.ep.size() > 1 and self._act_q.fmt == "nvfp4" and \
                self.trace_config.activation_amax == "per_tensor" and self.trace_quantizes(FC1):
            raise ValueError(
                f"activation_amax='per_tensor' with expert_model_parallel_size={self._trace_pg.ep.size()} needs "
                "the trace_guidance context (trace_guidance(model, None) for plain FP4 QAT): it carries each "
                "token's amax from its source rank; without it the amax would be over the rows this rank received, "
                "which depends on the EP size. Or use activation_amax='per_row' (the default)")
        rows = step.expert_rows(self, tokens_per_expert) if step is not None else ExpertRows()
        x, _ = self._site(FC1, x, rows.fc1, amax=rows.fc1_amax)
        h = self._activation(self._fc1(x, tokens_per_expert))  # [N, F]
        record = step is not None and step.recording_fc2
        h, q2 = self._site(FC2, h, rows.fc2, record=record)
        if record:
            step.record_fc2(self, q2)
        y = self._fc2(h, tokens_per_expert)  # [N, H]
        return (y * probs.unsqueeze(-1)).to(y.dtype), None

    # ---- guidance rows through the layer's own dispatcher class --------------------------------
    def _dispatcher(self):
        if self._payload_dispatcher is None:
            cfg = copy.copy(self.config)
            # one expert per virtual token; plain torch permutation (works for any dtype)
            cfg.moe_router_topk = 1
            cfg.moe_permute_fusion = False
            cfg.moe_shared_expert_overlap = False
            ep = self._trace_pg.ep
            first = ep.rank() * self.num_local_experts
            local = list(range(first, first + self.num_local_experts))
            cls = _DISPATCHERS[cfg.moe_token_dispatcher_type]
            self._payload_dispatcher = cls(self.num_local_experts, local, config=cfg, pg_collection=self._trace_pg)
        return self._payload_dispatcher

    def dispatch_payload(self, payload: torch.Tensor, experts: torch.Tensor, num_experts: int, probs_dtype):
        """Virtual tokens (one per (token, expert), ``payload`` uint8 [Nv, C], their expert [Nv]) ->
        (rows [N, C] in the experts' permuted order, rows per local expert). ``probs_dtype`` is the
        dtype of the combine path (float32 when rows come back, else uint8: fewer bytes to move).

        Without expert or expert-tensor parallelism every row stays on this rank and the dispatcher's
        permutation is a stable sort by expert, so the rows are permuted here without a dispatcher pass."""
        self._payload_order = None
        if self._local_payload():
            order, counts = self.local_payload_order(experts, num_experts)
            self._payload_order = order
            return payload.index_select(0, order), counts
        return self._dispatch_payload(payload, experts, num_experts, probs_dtype)

    def local_payload_order(self, experts: torch.Tensor, num_experts: int):
        """Without expert or expert-tensor parallelism (``_local_payload``): (the permutation [Nv] that
        ``dispatch_payload`` applies to the virtual tokens of experts ``experts`` [Nv], rows per expert)."""
        order = torch.sort(experts, stable=True).indices  # [Nv]: expert-major, token order within one
        counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)  # (bincount syncs)
        return order, counts.index_add_(0, experts, torch.ones_like(experts))

    def _local_payload(self) -> bool:
        tp_ep = getattr(self._trace_pg, "tp_ep", None)
        return (tp_ep is not None and tp_ep.size() == 1
                and self.config.moe_token_dispatcher_type in ("allgather", "alltoall"))

    def _dispatch_payload(self, payload: torch.Tensor, experts: torch.Tensor, num_experts: int, probs_dtype):
        """``dispatch_payload`` through the layer's own dispatcher class (any parallelism)."""
        d = self._dispatcher()
        routing = torch.nn.functional.one_hot(experts, num_experts).bool()  # [Nv, E]
        probs = routing.to(probs_dtype)
        h, p = d.dispatch_preprocess(payload, routing, probs)
        h, p = d.token_dispatch(h, p)
        rows, counts, _ = d.dispatch_postprocess(h, p)
        return rows, counts

    def combine_payload(self, rows: torch.Tensor) -> torch.Tensor:
        """The reverse path (float32 rows [N, C] -> [Nv, C] on the virtual tokens' ranks)."""
        if self._payload_order is not None:
            return torch.empty_like(rows).index_copy_(0, self._payload_order, rows)
        d = self._payload_dispatcher
        return d.combine_postprocess(d.token_combine(d.combine_preprocess(rows)))


class TraceSequentialMLP(TraceExpertsCore, SequentialMLP):
    """Torch variant. Parameters and checkpoints are SequentialMLP's
    (``local_experts.{i}.linear_fc1.weight`` [2F or F, H], ``...linear_fc2.weight`` [H, F]); the
    forward runs one grouped GEMM over all local experts (``torch._grouped_mm`` on CUDA)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, *, trace_config: TraceConfig,
                 gemm_impl: str = "auto"):
        SequentialMLP.__init__(self, num_local_experts, config, submodules, pg_collection)
        self._init_trace(trace_config, pg_collection)
        self.gemm_impl = gemm_impl
        self.pack_weights()

    def pack_weights(self) -> None:
        """Each linear's expert weights side by side in one buffer (``expert_weights.pack``: no stack copy per
        forward). Call again after something re-seats the parameters (a module ``.to()`` that copies), before
        the optimizer is built."""
        for name in ("linear_fc1", "linear_fc2"):
            expert_weights.pack(expert_weights.of(self.local_experts, name))

    _prepare_hooked = False  # hook_moe_layer ran (once per module)

    def hook_moe_layer(self, moe) -> None:
        if not self._prepare_hooked:
            moe.register_forward_pre_hook(_prepare_experts_weights)
            self._prepare_hooked = True

    def prepare_weights(self) -> None:
        """Fake-quantize both linears' weights now, for this module's next forward.

        ``find_trace_layers`` runs this as a forward pre-hook of the MoE layer, ahead of the router and the token
        dispatcher's host sync. The host's work for the weights (listing and stacking them, the quantize call) then
        overlaps the GPU's attention, and after the sync the host launches the expert GEMMs at once instead of
        leaving the GPU idle while it prepares them. Same values and gradients: the forward uses the prepared
        weights only if every weight still has the storage and version counter it had here (else it quantizes
        again, as without the hook)."""
        if not EARLY_WEIGHTS:
            return
        prepared = {}
        for name in ("linear_fc1", "linear_fc2"):
            weights = expert_weights.of(self.local_experts, name, pre_hooks=True)
            prepared[name] = (weights_key(weights), self._stacked(name, weights))
        self._prepared = prepared

    def _stacked(self, name: str, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """[E_local, M, K] fake-quantized weights of ``linear_fc1`` or ``linear_fc2`` (computed once per
        ``reuse_weight_quant`` scope; taken from ``prepare_weights`` where it ran for this forward)."""
        if weights is None:
            kept = self._prepared.pop(name, None) if self._prepared else None
            if kept is not None:  # (prepare_weights ran the linears' pre-hooks)
                weights = expert_weights.of(self.local_experts, name)
                if kept[0] == weights_key(weights):
                    return kept[1]
            weights = expert_weights.of(self.local_experts, name, pre_hooks=True)
        make = lambda: self.quantize_weights(expert_weights.stacked(weights))  # noqa: E731
        if self._weight_reuse is None or not self.trace_quantizes("weights"):
            return make()
        return reuse_or_make(self._weight_reuse, name, weights, make)

    def _fc1(self, x, tokens_per_expert):
        return grouped_linear(x, self._stacked("linear_fc1").to(x.dtype), tokens_per_expert, self.gemm_impl)

    def _fc2(self, h, tokens_per_expert):
        return grouped_linear(h, self._stacked("linear_fc2").to(h.dtype), tokens_per_expert, self.gemm_impl)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        try:
            return self._trace_forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        finally:
            self._prepared = None  # (unused prepared weights are not kept past this forward)


def _prepare_experts_weights(moe, args) -> None:
    """Forward pre-hook of a MoE layer with TRACE torch experts: prepares the experts of the layer it is called
    with (a module-level function, not a closure over one experts module)."""
    moe.experts.prepare_weights()
