"""``hf``: the embedded rollout backend, a transformers Qwen3-MoE causal LM (CPU or GPU).

Modes: ``"bf16"`` (no quantization: the model in its dtype) and ``"fp4"`` (TRACE rollout
numerics: routed experts W4A4 with ``TraceConfig.weight_quantizer()`` /
``activation_quantizer(rollout=True)`` at ``expert_fc1_in`` and ``expert_fc2_in``, and an FP4 KV cache
(``kv_quantizer(rollout=True)``: ``TraceConfig.format``, or SGLang's format with ``kv_format="sglang_kvfp4"``);
each as enabled by ``TraceConfig.sites``; RNE whatever the trainer's ``TraceConfig.rounding``). In FP4 mode the
backend records guidance at the selected (layer, site) pairs for prompt and response positions; in both modes it
records every MoE layer's expert choices. Log-probs come from the same forward that sampled.

Prefix reuse (``prefix_reuse=True``, GRPO's G samples per prompt): identical prompts of a batch are
prefilled once; their KV cache rows, routing and guidance records are then copied to every sample
(per KV slot, so records always describe the K/V the sample decodes with). Nothing outlives a
``generate`` call, so a weight update never meets a stale prefix.

Quant-recipe manifest: ``recipe()`` is what this backend serves; ``check_recipe(trainer_recipe)`` (or
``recipe=`` at construction) compares it with the trainer's and, once registered, every
``update_weights`` must carry the trainer's recipe for the new weight version.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext

import torch
from transformers import PreTrainedModel, Qwen3MoeConfig
from transformers.cache_utils import Cache, DynamicCache

from ..config import TraceConfig
from ..formats import FP4Tensor
from ..guidance.selection import guided_layers
from ..guidance.site import SiteKey
from ..kernels import Kernel, select_kernel
from ..manifest import (
    ModuleAudit,
    QuantRecipe,
    RecipeMismatchError,
    check_guided_layers,
    check_recipe,
    excluded_modules,
    experts_name,
    kv_cache_name,
    unguided_layers,
)
from . import hf_generate
from .attention import ROLLOUT_ATTENTION
from .audit import backend_recipe, effective_config, hf_module_audit
from .base import (
    COMPILE_CHOICES,
    STATIC_DECODE,
    RolloutBatch,
    SamplingParams,
    WeightValue,
    is_compile_choice,
    is_int,
    next_policy_version,
    recipe_kept_on_failure,
    refuse_after_failed_update,
    weight_pairs,
)
from .compiled import LAYER_TRACE_CONFIG, compile_layers, compile_small_modules
from .experts import EXPERTS_IMPLEMENTATION, FC1, FC2, ExpertWeightStore, RolloutNumerics, active_numerics
from .finite import RolloutFiniteChecks
from .hf_model import check_fc1_pairs, checked_fp4_updates, load_model, routed_experts, sort_updates
from .hf_weights import check_dense_updates
from .kv_cache import FP4KVCache
from .recorder import GuidanceRecorder

logger = logging.getLogger(__name__)

MODES = ("bf16", "fp4")


class HFRolloutBackend:
    """A ``RolloutBackend`` over a transformers Qwen3-MoE model.

    model: HF checkpoint directory, ``Qwen3MoeConfig`` (random init) or a loaded model (the
        backend takes it over: FP4 mode overwrites expert weights with their decoded values).
    mode: "bf16" (no quantization) or "fp4" (the sites of ``trace_config``; one that quantizes nothing is refused).
    guided_layer_ids: layers that record guidance (default: ``guided_layers(trace_config, L)``).
    recipe: the trainer's ``QuantRecipe``, checked now and required on every ``update_weights``.
    ``trace_config.exclude_modules``: those routed experts (FP4 weights, both activation sites) and KV
        caches stay in the model dtype and record no guidance; a pattern that matches none of the
        model's experts/KV caches raises ``ModulePatternError`` here (in BF16 mode too).
    prefix_reuse: prefill identical prompts of a batch once (see the module docstring).
    fused_kv_attention: decode steps read the FP4 KV cache with the fused dequant+attention kernel
        (``rollout.attention``) instead of dequantizing the history for SDPA. None (default): on where the
        Triton kernels run (CUDA, ``TraceConfig.kernel`` auto/triton) with a bf16/fp16 model and SDPA attention;
        always off with ``TraceConfig.kv_format="sglang_kvfp4"``, and where the kernels cannot read the K/V rows (a
        head_dim not a power of two, or not a multiple of the FP4 block: True raises then).
    fast_kv_attention: the fused decode attention's fast kernel (default; K/V as exact FP4 values, ~6x faster at
        long context) instead of the one that reads the trainer's bf16 K/V values (``kernels.kv_attention``);
        the RL mismatch is the same within seed noise (BENCHMARKS.md, session 5).
    static_decode: "auto" (default), "off", "eager" or "graph": ``generate``'s decode steps run on fixed buffers
        (``rollout.static_decode``: a static KV cache of prompt + ``max_new_tokens`` rows, the recorder's static
        buffers); "graph" captures the step in a CUDA graph once per ``generate``, after its first step (run eagerly,
        the capture's warm-up), and replays it (the eager loop is
        host-bound on the GPU: 5-15x the tokens/s on the H200, BENCHMARKS.md session 14). "auto": "graph" on CUDA
        where ``fused_kv_attention`` is on and K and V are both FP4 or both not (every decode step's attention is
        then a kernel over the static buffers: the FP4 one, or the dense one for BF16 layers; only one of K, V
        in FP4 would take SDPA's masked path over all buffer rows), else "off" (the growing cache).
    compile: ``torch.compile`` the transformers code around this package's (``rollout.compiled``). True or
        "modules": every RMSNorm and MoE router (Inductor fuses each into one or two kernels); "layers": every
        decoder layer (RoPE, residual adds and norms fused too; this package's experts, attention and KV cache run
        eagerly inside); both also compile, on the grouped GPU path, the routing and row plumbing around the
        expert GEMMs. The GEMMs, quantizers, KV cache and attention stay this package's kernels. Outputs agree with
        the eager model within the model dtype's rounding; the first steps of a new shape pay the compilation.
    ``trace_config.kv_format="sglang_kvfp4"``: the FP4 KV cache stores and records K/V in SGLang's format
        (``formats.sglang_kvfp4``, reference path), the records a trainer with the same ``kv_format`` accepts.
    GPU path (``TraceConfig.kernel`` "auto" on CUDA, bf16): routed experts run one grouped GEMM per matrix kind
    (FP4 mode: the Triton W4A16 kernel on the packed weights; BF16 mode: ``torch._grouped_mm``) with Triton
    activation quantizers, and the FP4 KV cache quantizes/dequantizes with Triton: same codes as the reference
    path, outputs equal within bf16 rounding (``"reference"`` keeps the bit-exact per-expert emulation).
    NaN/Inf in a quantize site's input (``rollout.finite``): ``generate`` raises ``NonFiniteError`` naming every
    ``layer <i> <site>`` that saw one (the GPU path counts them on the device and reads the counts once, at the end)
    and returns nothing of that batch; ``check_finite`` reads them after direct ``forward_context`` runs.
    All returned tensors live on ``device``.
    """

    def __init__(
        self,
        model: str | os.PathLike | Qwen3MoeConfig | PreTrainedModel,
        *,
        mode: str = "fp4",
        trace_config: TraceConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        attn_implementation: str = "sdpa",
        guided_layer_ids: Sequence[int] | None = None,
        recipe: QuantRecipe | None = None,
        prefix_reuse: bool = True,
        fused_kv_attention: bool | None = None,
        fast_kv_attention: bool = True,
        compile: bool | str = False,
        static_decode: str = "auto",
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if trace_config is not None and not isinstance(trace_config, TraceConfig):  # (a dict: AttributeError)
            raise TypeError(f"trace_config must be a TraceConfig (TraceConfig.from_dict for a dict), got "
                            f"{type(trace_config).__name__}")
        flags = {"prefix_reuse": prefix_reuse, "fast_kv_attention": fast_kv_attention, "fused_kv_attention":
                 fused_kv_attention if fused_kv_attention is not None else False}
        bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
        if bad:  # ("no" is truthy: it turned the option on)
            raise ValueError(f"{bad} must be bools (fused_kv_attention: or None, the default)")
        if static_decode not in STATIC_DECODE:
            raise ValueError(f"static_decode={static_decode!r} must be one of {STATIC_DECODE}")
        if static_decode == "graph" and torch.device(device).type != "cuda":
            raise ValueError(f"static_decode='graph' captures CUDA graphs: device={device!r} is not CUDA "
                             "(static_decode='eager' runs the same fixed-buffer steps without a graph)")
        if dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise ValueError(f"dtype={dtype} must be torch.bfloat16, torch.float16 or torch.float32")
        self.mode = mode
        self.config = trace_config if trace_config is not None else TraceConfig()
        if mode == "fp4" and not (self.config.enabled and self.config.sites):  # (it served BF16 as 'fp4')
            raise ValueError(f"mode='fp4' with a TraceConfig that quantizes nothing (enabled={self.config.enabled}, "
                             f"sites={self.config.sites}): use mode='bf16' for an unquantized rollout")
        self.device = torch.device(device)
        self.model = load_model(model, dtype, self.device, attn_implementation).eval()
        self.model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        if attn_implementation == "sdpa":  # SDPA, except decode steps over a deferred FP4 KV history
            self.model.set_attn_implementation(ROLLOUT_ATTENTION)
        self.hf_config = self.model.config
        self.num_layers = self.hf_config.num_hidden_layers
        self.vocab_size = self.hf_config.vocab_size
        pad = self.hf_config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None and 0 <= pad < self.vocab_size else 0
        self.policy_version = 0
        self.failed_update: str | None = None  # why the model may hold mixed weights (generate refuses until mended)
        self._unsent: set[str] = set()  # the names of a failed update's tensors not sent again since
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._experts = routed_experts(self.model)
        self._layer_of = {id(m): i for i, m in self._experts.items()}
        excluded = excluded_modules(self.config, moe_layers=self._experts, attention_layers=range(self.num_layers))
        self.bf16_expert_layers = frozenset(i for i in self._experts if experts_name(i) in excluded)
        self.bf16_kv_layers = frozenset(i for i in range(self.num_layers) if kv_cache_name(i) in excluded)
        self.finite_checks = RolloutFiniteChecks()  # NaN/Inf counters of the activation / KV quantize calls
        self.weight_store: ExpertWeightStore | None = None
        if self._quantizes("weights"):
            self.weight_store = ExpertWeightStore(self.config.weight_quantizer())
            self._quantize_experts({(layer, e, w) for layer, m in self._experts.items()
                                    if layer not in self.bf16_expert_layers
                                    for e in range(m.num_experts) for w in (FC1, FC2)})
        self.set_guided_layers(guided_layer_ids)
        self.prefix_reuse = bool(prefix_reuse)
        self.fast_kv_attention = fast_kv_attention
        self.fused_kv_attention = self._fused_default(attn_implementation) if fused_kv_attention is None \
            else bool(fused_kv_attention) and attn_implementation == "sdpa" and not self.config.kv_format
        unfit = self._fused_unfit(static_decode) if self.fused_kv_attention else ""
        if unfit and fused_kv_attention:
            raise ValueError(f"fused_kv_attention=True: {unfit} (fused_kv_attention=False or None dequantizes the "
                             "history for SDPA)")
        self.fused_kv_attention = self.fused_kv_attention and not unfit
        if static_decode in ("eager", "graph") and self.config.kv_format and (
                self._quantizes("kv_k") or self._quantizes("kv_v")):
            raise ValueError(f"static_decode={static_decode!r} needs the activation quantizer's KV format: "
                             f"kv_format={self.config.kv_format!r} quantizes K/V on the reference path only "
                             "(static_decode='off' or 'auto' runs it)")
        if static_decode == "auto":  # graphs where every decode attention is a kernel over the static buffers
            kernels = self.fused_kv_attention and self._quantizes("kv_k") == self._quantizes("kv_v")
            static_decode = "graph" if self.device.type == "cuda" and kernels else "off"
        self.static_decode = static_decode
        if not is_compile_choice(compile):
            raise ValueError(f"compile={compile!r} must be one of {COMPILE_CHOICES}")
        compile_mode = {False: None, True: "modules"}.get(compile, compile)
        compiler = {"modules": compile_small_modules, "layers": compile_layers}.get(compile_mode)
        self.compiled_modules = compiler(self.model) if compiler else []
        self.layers_compiled = compile_mode == "layers" and bool(self.compiled_modules)
        self.trainer_recipe: QuantRecipe | None = None
        self._recipe_ignore: tuple[str, ...] = ()
        if recipe is not None:
            self.check_recipe(recipe)

    # ---- configuration ------------------------------------------------------------------------
    def _quantizes(self, site: str) -> bool:
        return self.mode == "fp4" and self.config.quantizes(site)

    def _fused_default(self, attn_implementation: str) -> bool:
        if attn_implementation != "sdpa" or self.model.dtype not in (torch.bfloat16, torch.float16):
            return False
        if self.config.kv_format:  # SGLang's KV format: dequantize + SDPA (the fused kernel reads NVFP4/MXFP4)
            return False
        return select_kernel(self.config.kernel, self.device) is Kernel.TRITON

    def _fused_unfit(self, static_decode: str) -> str:
        """Why the decode attention kernels cannot read this model's K/V rows ("" if they can; every generate
        raised): layers with K and V both FP4 need a power-of-two head_dim that is a multiple of the KV block (the
        cache pads a shorter row to one block), a static cache's unquantized layers a power-of-two head_dim."""
        c = self.hf_config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        both = self._quantizes("kv_k") and self._quantizes("kv_v")
        if d & (d - 1) and (both or static_decode in ("eager", "graph")):
            return f"head_dim={d} is not a power of two"
        block = self.config.kv_quantizer(rollout=True).block_size
        if both and d % block:
            return f"head_dim={d} is not a multiple of the {self.config.format} KV block {block}"
        return ""

    def _bf16_site(self, layer: int, site: str) -> bool:
        """Whether ``TraceConfig.exclude_modules`` keeps this (layer, site) in the model dtype."""
        return layer in (self.bf16_kv_layers if site.startswith("kv_") else self.bf16_expert_layers)

    def set_guided_layers(self, layer_ids: Sequence[int] | None = None) -> None:
        """Choose the layers that record guidance (None: the TraceConfig policy). An explicit layer without a
        quantized guided module (a dense layer under expert sites, experts ``exclude_modules`` keeps in BF16) is an
        error, as in ``guided_layer_list``."""
        explicit = layer_ids is not None
        if layer_ids is None:
            layer_ids = guided_layers(self.config, self.num_layers) if self.mode == "fp4" else ()
            check_guided_layers(self.config, layer_ids, moe_layers=self._experts)  # (the policy guiding nothing)
        if isinstance(layer_ids, str | bytes) or not isinstance(layer_ids, Iterable):  # (2 was "not iterable")
            raise TypeError(f"guided layer ids {layer_ids!r} must be a list of ints, or None (the TraceConfig policy)")
        kinds = [i for i in layer_ids if not is_int(i)]
        if kinds:
            raise TypeError(f"guided layer id {kinds[0]!r} ({type(kinds[0]).__name__}) must be an int")
        layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"guided layer id(s) {bad} outside 0..{self.num_layers - 1}")
        sites = [s for s in self.config.guided_sites if self._quantizes(s)]
        if explicit and layer_ids and not sites:  # (BF16 mode's recipe named them, nothing recorded)
            raise ValueError(f"set_guided_layers({layer_ids}): mode={self.mode!r} with guided_sites="
                             f"{self.config.guided_sites} quantizes no guided site; pass [] or None")
        empty = unguided_layers(self.config, layer_ids, moe_layers=self._experts, explicit=True) if sites else []
        if explicit and empty:  # (a policy's layers were checked above, by its own rule)
            raise ValueError(f"set_guided_layers: layer(s) {empty} would guide nothing: their guided sites {sites} are "
                             f"in no quantized module of theirs (MoE layers: {sorted(self._experts)}; exclude_modules: "
                             f"{list(self.config.exclude_modules)}); pass layers whose modules are quantized")
        guided = {(layer, s) for layer in layer_ids for s in sites if s.startswith("kv_") or layer in self._experts}
        self._guided_layer_ids = set(layer_ids)  # the policy's layers (the recipe), as the trainer lists them
        self.guided_sites: set[SiteKey] = {k for k in guided if not self._bf16_site(*k)}

    # ---- manifest -----------------------------------------------------------------------------
    def module_audit(self) -> ModuleAudit:
        """The modules this backend quantizes and those it keeps in the model dtype."""
        return hf_module_audit(self.model, effective_config(self.config, self.mode), moe_layers=self._experts,
                               num_layers=self.num_layers)

    def recipe(self, weight_version: int | None = None) -> QuantRecipe:
        """The recipe this backend serves (weight version: ``policy_version`` unless given)."""
        v = self.policy_version if weight_version is None else weight_version
        return backend_recipe(effective_config(self.config, self.mode), guided_layers=self._guided_layer_ids,
                              audit=self.module_audit(), weight_version=v, dtype=self.model.dtype)

    def check_recipe(self, trainer: QuantRecipe, *, weight_version: int | None = None,
                     ignore: tuple[str, ...] | None = None) -> None:
        """Raise ``RecipeMismatchError`` naming every field where ``trainer`` differs; then require it on syncs.

        ``ignore``: fields allowed to differ, e.g. a rollout that deliberately records guidance on more layers than
        the trainer uses; kept for later syncs, as the recipe is, once the check passes."""
        ignored = self._recipe_ignore if ignore is None else tuple(ignore)
        check_recipe(trainer, self.recipe(weight_version), what="hf rollout", ignore=ignored)
        self.trainer_recipe, self._recipe_ignore = trainer, ignored

    def _numerics(self, recorder: GuidanceRecorder | None) -> RolloutNumerics:
        q = self._quantizes
        return RolloutNumerics(
            layer_of=self._layer_of,
            activation_quantizer=self.config.activation_quantizer(rollout=True),
            quantize_fc1=q("expert_fc1_in"), quantize_fc2=q("expert_fc2_in"), recorder=recorder,
            bf16_layers=self.bf16_expert_layers, kernel=self.config.kernel, weight_store=self.weight_store,
            compiled=bool(self.compiled_modules), finite=self.finite_checks,
        )

    def new_cache(self, recorder: GuidanceRecorder | None = None, *, interval_masks: bool = False,
                  static_rows: int | None = None) -> Cache:
        """An ``FP4KVCache`` when K or V is quantized (or the layers are compiled: its update stays eager; or
        ``static_rows`` is given), else a ``DynamicCache``. ``interval_masks``: the caller's decode masks attend one
        interval per row (see ``FP4KVCache``; ``generate``'s do). ``static_rows``: a static cache of that many
        rows (``rollout.static_decode``)."""
        qk, qv = self._quantizes("kv_k"), self._quantizes("kv_v")
        if not (qk or qv or self.layers_compiled or static_rows is not None):
            return DynamicCache(config=self.hf_config)
        return FP4KVCache(self.num_layers, self.config.kv_quantizer(rollout=True), quantize_k=qk, quantize_v=qv,
                          recorder=recorder, bf16_layers=self.bf16_kv_layers, kernel=self.config.kernel,
                          fused_decode=self.fused_kv_attention, fast_attention=self.fast_kv_attention,
                          interval_masks=interval_masks, static_rows=static_rows, finite=self.finite_checks)

    def cache_kwargs(self, cache: Cache) -> dict:
        """The model's keyword for a cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
        return {self._cache_kw: cache}

    def check_finite(self) -> None:
        """Raise ``NonFiniteError`` naming every ``layer <i> <site>`` whose FP4 quantize inputs held NaN/Inf since the
        last check (one host read; ``rollout.finite``). ``generate`` checks at its end; a caller that runs the model
        in ``forward_context`` calls this (else the next ``generate`` reports them)."""
        self.finite_checks.read()

    @contextmanager
    def forward_context(self, recorder: GuidanceRecorder | None = None):
        """Run ``self.model`` directly with the rollout numerics (experts; pass ``new_cache()`` for KV). The Triton
        quantize calls count NaN/Inf inputs for ``check_finite``."""
        traced = torch._dynamo.config.patch(**LAYER_TRACE_CONFIG) if self.layers_compiled else nullcontext()
        with torch.no_grad(), active_numerics(self._numerics(recorder)), traced:
            yield self.model

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutBatch:
        """Sample responses to ``prompts`` (``rollout.hf_generate``): tokens, log-probs of the sampling forward,
        routing and (FP4 mode) guidance, as a ``RolloutBatch``."""
        refuse_after_failed_update(self, "model")
        return hf_generate.generate(self, prompts, sampling)

    # ---- weights ------------------------------------------------------------------------------
    def expert_weight_fp4(self, layer: int, expert: int, which: str) -> FP4Tensor:
        """The rollout's stored FP4 weight of a routed expert (``which``: "fc1" = [gate; up], "fc2")."""
        if self.weight_store is None:
            raise RuntimeError(f"no FP4 expert weights: mode={self.mode!r}, sites={self.config.sites}")
        return self.weight_store.get(layer, expert, which)

    def _apply(self, dense, requant, packed, names: set[str], version: int) -> None:
        """The checked update -> the model, in place. A failure here (a device copy out of memory, an interrupt) may
        leave some tensors new: ``failed_update`` is set and ``generate`` refuses until updates that succeed have sent
        all of them again (as the SGLang backend does)."""
        try:
            with torch.no_grad():
                for target, value, _ in dense:
                    target.copy_(value.to(target.device))
                if self.weight_store is not None:
                    self._quantize_experts(requant)
                    for layer, e, which, q in packed:
                        self.weight_store.set(self._experts[layer], layer, e, which, q)
        except BaseException as e:
            self._unsent |= names
            self.failed_update = (f"the weight update to version {version} failed while copying into the model "
                                  f"({type(e).__name__}: {e})")
            logger.error("%s: generate is refused until updates that succeed have sent its tensors again",
                         self.failed_update)
            raise

    def _quantize_experts(self, keys: Iterable[tuple[int, int, str]]) -> None:
        for layer, e, which in sorted(keys):
            self.weight_store.quantize_from_params(self._experts[layer], layer, e, which)

    def update_weights(self, weights: Iterable[tuple[str, WeightValue]], *, version: int | None = None,
                       recipe: QuantRecipe | None = None, reset: bool = False) -> None:
        """Copy HF-checkpoint-named weights in place (see ``RolloutBackend.update_weights``).

        In FP4 mode a BF16 fc1 update must carry both gate_proj and up_proj of an expert (they
        are quantized as one matrix); FP4 values must come as gate/up pairs sharing one amax.
        ``version``: strictly greater than ``policy_version`` (None: +1); ``reset=True``: any version, on purpose
        (``base.next_policy_version``). ``recipe``: the trainer's recipe for these weights (``weight_version`` = the
        new version); required once a trainer recipe was registered. Everything (the version first) is validated
        before anything is copied.
        """
        new_version = next_policy_version(self.policy_version, version, reset=reset)
        with recipe_kept_on_failure(self):
            if recipe is not None:
                self.check_recipe(recipe, weight_version=new_version)
            elif self.trainer_recipe is not None:
                raise RecipeMismatchError(
                    f"update_weights to version {new_version} without the trainer's recipe: a recipe was registered, "
                    f"so every weight sync must pass recipe=trainer_recipe.with_weight_version({new_version})")
            weights = weight_pairs(weights)
            dense, halves, fp4 = sort_updates(weights, self.model.state_dict(keep_vars=True), self._experts,
                                              self.weight_store, self.bf16_expert_layers)
            check_dense_updates(dense)
            requant = set() if self.weight_store is None else check_fc1_pairs(halves, fp4)
            packed = checked_fp4_updates(self.weight_store, self._experts, fp4)
            names = {name for name, _ in weights}
            self._apply(dense, requant, packed, names, new_version)
        self.policy_version = new_version
        self._unsent -= names
        if not self._unsent:
            self.failed_update = None
        logger.debug("update_weights: %d tensors, version %d", len(weights), self.policy_version)

