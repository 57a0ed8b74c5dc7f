"""``SGLangRolloutBackend``: the rollout protocol (``generate``, ``update_weights``) on a running Engine."""

from __future__ import annotations

import base64
import dataclasses
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from ...config import TraceConfig
from ...formats import NonFiniteError, sglang_kvfp4
from ...guidance.selection import guided_layers
from ...manifest import (
    KV_SITES,
    ModuleAudit,
    QuantRecipe,
    RecipeMismatchError,
    check_recipe,
    excluded_modules,
    experts_name,
    kv_cache_name,
)
from ..audit import backend_recipe, exclude_list, sglang_module_audit, sglang_moe_layers, without_kv
from ..base import (
    RolloutBatch,
    SamplingParams,
    WeightValue,
    check_prompts,
    is_int,
    next_policy_version,
    nonfinite_names,
    recipe_kept_on_failure,
    refuse_after_failed_update,
    weight_pairs,
)
from .capture import INFO_KEY, READOUT_PREFIX
from .launch import (
    KV_FP4,
    METHOD_NAME,
    WEIGHT_LOADER,
    check_capture_settings,
    check_kv_cache_dtype,
    check_kv_sites,
    check_serves_format,
    check_serves_fp4_weights,
    check_sharded_capture,
    guidance_specs,
    needs_routing,
)
from .launch import kv_cache_dtype as default_kv_cache_dtype
from .native import native_fp4_available
from .records import assemble
from .weights import WeightsUpdateGroup, engine_tensors

logger = logging.getLogger(__name__)
NATIVE_ACTIVATION_AMAX = "static_input_scale"


def sampling_dict(s: SamplingParams, index: int = 0) -> dict:
    """Our SamplingParams as SGLang's sampling_params dict for request ``index`` of a batch (stop tokens kept in
    the output; like the hf backend, generation ends only at ``stop_token_ids`` or ``max_new_tokens``).
    ``ignore_eos`` only without stop tokens: SGLang 0.5.10's ``ignore_eos`` skips ``stop_token_ids`` too
    (``Req._check_token_based_finish``), so every response ran to ``max_new_tokens`` past its stop token. With
    stop tokens the engine also stops at the model's EOS ids: ``SGLangRolloutBackend.generate`` refuses a response
    that ended at a token not listed. ``seed``: request i gets ``sampling_seed = seed + i`` (mod 2**63): SGLang's
    seeded sampler draws from (seed, position) alone, so one seed for all would give every copy of a prompt (a GRPO
    group) the same response."""
    d = {"temperature": float(s.temperature), "top_p": float(s.top_p), "max_new_tokens": int(s.max_new_tokens),
         "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": False, "no_stop_trim": True,
         "ignore_eos": not s.stop_token_ids}
    if s.seed is not None:
        d["sampling_seed"] = (int(s.seed) + int(index)) % 2**63
    return d


def decode_routing(b64: str, seq_len: int, num_layers: int) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 int32 [seqlen-1, layers, topk]) -> int64 [seqlen-1, layers, topk]."""
    a = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    return torch.from_numpy(a.copy()).long().reshape(seq_len - 1, num_layers, -1)


def _finish_type(reason) -> str | None:
    """meta_info["finish_reason"] -> its type ("stop", "length", "abort", ...): SGLang sends a dict with a "type"
    (``BaseFinishReason.to_json``); a bare string is read as the type itself."""
    return reason.get("type") if isinstance(reason, dict) else reason


_SERVER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                  "float32": torch.float32, "float": torch.float32}


def sglang_model_dtype(dtype: str | None, hf_config) -> torch.dtype:
    """The dtype SGLang 0.5.10 runs a model in for ``ServerArgs.dtype`` (None: its default, ``"auto"``), as
    ``sglang/srt/configs/model_config.py::_get_and_verify_dtype`` resolves it: ``"auto"`` takes the config's
    ``dtype`` (else ``torch_dtype``; missing or unknown = float32), except float32, served in float16 (bfloat16 for
    a Gemma ``model_type``); another name is looked up case-insensitively and an unknown one is an error."""
    name = "auto" if dtype is None else str(dtype).lower()
    if name != "auto":
        if name not in _SERVER_DTYPES:
            raise ValueError(f"ServerArgs.dtype={dtype!r} is not one SGLang knows; valid: 'auto', "
                             f"{sorted(_SERVER_DTYPES)}")
        return _SERVER_DTYPES[name]
    get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
    cfg = get("dtype", None) or get("torch_dtype", None)
    if isinstance(cfg, str):
        cfg = _SERVER_DTYPES.get(cfg)  # (SGLang's table holds the same five names)
    if cfg is None or cfg == torch.float32:
        return torch.bfloat16 if str(get("model_type", "") or "").startswith("gemma") else torch.float16
    return cfg


def engine_kv_cache_dtype(engine, told: str | None, trace_config: TraceConfig) -> str:
    """The KV cache dtype the engine serves: its resolved ``server_args.kv_cache_dtype`` where it has one, else
    ``told``, else what ``trace_server_args`` sets for ``trace_config``. ``told`` against the engine's: FP4 K/V on
    one side and BF16 on the other is refused (an engine launched otherwise than told here: its FP4 K/V were
    reported as BF16 and a trainer without KV sites passed the recipe check, or BF16 K/V got KV records whose read-out
    failed inside the engine)."""
    served = getattr(getattr(engine, "server_args", None), "kv_cache_dtype", None)
    served = served if isinstance(served, str) else None
    for value in (served, told):
        if value is not None:
            check_kv_cache_dtype(value)
    if served is not None and told is not None and (served == KV_FP4) != (told == KV_FP4):
        raise ValueError(f"kv_cache_dtype={told!r} was given, but the engine serves kv_cache_dtype={served!r} "
                         f"(its server_args): K/V stored in {'FP4' if served == KV_FP4 else 'BF16'}, not "
                         f"{'FP4' if told == KV_FP4 else 'BF16'}; pass kv_cache_dtype={served!r} or None")
    if served is not None:
        return served
    return default_kv_cache_dtype(trace_config) if told is None else told


class SGLangRolloutBackend:
    """Rollout through an SGLang Engine started with ``launch.make_engine(**trace_server_args(...))``.

    ``exclude_modules``: the checkpoint's ModelOpt ``exclude_modules`` (None: every non-expert
    module excluded, as ``export.modelopt`` writes); ``recipe``: the trainer's ``QuantRecipe``,
    checked now and required on every ``update_weights`` (as in the hf backend).
    ``kv_cache_dtype``: the engine's (None: the engine's resolved ``server_args.kv_cache_dtype`` where it has one,
    else ``launch.kv_cache_dtype(trace_config)``, what ``trace_server_args`` sets; one that disagrees with the
    engine's, FP4 against BF16 K/V, is refused). SGLang's FP4 KV cache is ``sglang_kvfp4`` (the recipe's
    ``kv_format``): a trainer with ``TraceConfig.kv_format="sglang_kvfp4"`` computes the same K/V and is guided by
    the KV records (``fmt="sglang_kvfp4"``). A trainer that quantizes KV in ``TraceConfig.format`` is rejected by
    ``check_recipe`` unless ``accept_kv_format_mismatch``; then the KV records travel with the rest, and the
    trainer's format check rejects them (counted as ``"format"``) and rounds K/V itself.
    ``native``: whether the engine runs SGLang's native NVFP4 MoE (None: this process's device has
    capability >= 10, as ``trace_server_args`` decides).
    The engine's resolved ``server_args`` (where it has them) are checked as ``trace_server_args`` sets them:
    ``quantization="trace_nvfp4"``, the TRACE ``custom_weight_loader`` for in-process syncs, the capture's
    ``REQUIRED`` settings and ``tp_size``, ``enable_return_routed_experts`` where the routing is needed.
    """

    def __init__(self, engine, trace_config: TraceConfig, hf_config: dict, *, pad_token_id: int = 0,
                 weights_group: WeightsUpdateGroup | None = None, exclude_modules: list[str] | None = None,
                 recipe: QuantRecipe | None = None, kv_cache_dtype: str | None = None,
                 accept_kv_format_mismatch: bool = False, native: bool | None = None):
        check_serves_fp4_weights(trace_config)
        check_serves_format(trace_config)
        self.engine, self.config, self.hf_config = engine, trace_config, hf_config
        self.moe_layers = sglang_moe_layers(hf_config)  # (refuses another architecture or a dense layer, first)
        self.exclude_modules = exclude_list(exclude_modules)
        self.num_layers = int(hf_config["num_hidden_layers"])
        self.vocab_size = int(hf_config["vocab_size"])
        self.kv_cache_dtype = engine_kv_cache_dtype(engine, kv_cache_dtype, trace_config)
        check_kv_sites(trace_config, self.kv_cache_dtype)
        self.accept_kv_format_mismatch = accept_kv_format_mismatch
        self.native = native_fp4_available() if native is None else native
        if self.native and weights_group is not None and trace_config.quantizes("weights"):
            raise ValueError("the native NVFP4 MoE derives tensors from its weights at load, and SGLang's "
                             "update_weights_from_distributed does not re-derive them: sync in-process "
                             "(weights_group=None: update_weights_from_tensor with the TRACE loader)")
        excluded = excluded_modules(trace_config, moe_layers=self.moe_layers, attention_layers=range(self.num_layers))
        self.bf16_expert_layers = frozenset(i for i in self.moe_layers if experts_name(i) in excluded)
        bf16_kv = [n for n in excluded if n.endswith(".kv_cache")]
        if bf16_kv and self.kv_fp4:
            raise ValueError(f"TraceConfig.exclude_modules keeps {bf16_kv[:3]} in BF16, but SGLang's FP4 KV cache "
                             "(kv_cache_dtype=fp4_e2m1) quantizes every layer: drop those patterns or use a BF16 KV")
        self.specs = guidance_specs(trace_config, hf_config, kv_dtype=self.kv_cache_dtype)
        if self.specs and getattr(engine, "server_args", None) is not None:  # (as SGLang resolved them)
            check_capture_settings(engine.server_args)
            check_sharded_capture(self.specs, getattr(engine.server_args, "tp_size", 1))
        self.return_routing = needs_routing(trace_config, self.specs)  # (as trace_server_args launches the engine)
        if self.return_routing and getattr(getattr(engine, "server_args", None), "enable_return_routed_experts",
                                           None) is False:
            raise ValueError(f"TraceConfig.routing_replay={trace_config.routing_replay} or expert_fc2_in guidance "
                             "needs the routed experts, but the engine runs with enable_return_routed_experts=False "
                             "(its server_args): every generate would fail after sampling; launch it with "
                             "enable_return_routed_experts=True (trace_server_args sets it for this config)")
        self.pad_token_id = pad_token_id
        self.weights_group = weights_group
        quantization = getattr(getattr(engine, "server_args", None), "quantization", METHOD_NAME)  # (None: auto)
        if quantization != METHOD_NAME:
            raise ValueError(f"the engine runs with quantization={quantization!r} (its server_args), not "
                             f"{METHOD_NAME!r}: its experts neither round as the TRACE method nor record guidance (the "
                             "slot buffers would be read out unwritten); launch it with make_engine(**trace_server_args"
                             "(...))")
        loaders = getattr(getattr(engine, "server_args", None), "custom_weight_loader", None)
        if weights_group is None and isinstance(loaders, list) and WEIGHT_LOADER not in loaders:
            raise ValueError(f"the engine runs with custom_weight_loader={loaders} (its server_args), without "
                             f"{WEIGHT_LOADER!r}: update_weights sends load_format={WEIGHT_LOADER!r}, which SGLang "
                             "0.5.10 refuses with a NotImplementedError in the scheduler process; launch it with "
                             "trace_server_args (which lists it), or sync over a WeightsUpdateGroup")
        self.policy_version = 0
        self.trainer_recipe: QuantRecipe | None = None
        self.failed_update: str | None = None  # why the engine may hold mixed weights (generate refuses until mended)
        self._unsent: set[str] = set()  # the engine names of failed updates not sent again by a successful one since
        if recipe is not None:
            self.check_recipe(recipe)

    @property
    def kv_fp4(self) -> bool:
        return self.kv_cache_dtype == KV_FP4

    # ---- manifest -----------------------------------------------------------------------------
    def module_audit(self) -> ModuleAudit:
        """What the engine serves in FP4 (experts + any Linear the exclude patterns miss + the KV caches
        if FP4) vs BF16; ``TraceConfig.exclude_modules`` experts are BF16, as on the hf backend/trainer."""
        base = sglang_module_audit(self._served_config(), self.hf_config, self.exclude_modules)
        moved = {experts_name(i) for i in self.bf16_expert_layers}
        quantized = set(base.quantized) - moved
        if self.kv_fp4:  # the engine stores FP4 K/V whatever the TraceConfig says (one without KV sites too)
            quantized |= {kv_cache_name(i) for i in range(self.num_layers)}
        bf16 = set(base.bf16) | (moved & set(base.quantized))
        return ModuleAudit(quantized=tuple(sorted(quantized)), bf16=tuple(sorted(bf16)))

    def _served_config(self) -> TraceConfig:
        """The TraceConfig this engine serves: KV sites only with SGLang's FP4 KV cache."""
        return self.config if self.kv_fp4 else without_kv(self.config)

    def _served_dtype(self) -> torch.dtype:
        """The engine's model dtype: its ``server_args.dtype`` (``"auto"`` where not set, as ``trace_server_args``
        leaves it) resolved against ``hf_config`` as SGLang does (``sglang_model_dtype``): an exported checkpoint's
        config.json says bfloat16; a float32 or dtype-less config is served in float16."""
        name = getattr(getattr(self.engine, "server_args", None), "dtype", None)
        return sglang_model_dtype(name if isinstance(name, str) else None, self.hf_config)

    def recipe(self, weight_version: int | None = None) -> QuantRecipe:
        """What the engine serves. The native (Blackwell) MoE quantizes activations with the checkpoint's
        static input scale, not ``TraceConfig.activation_amax``: its recipe says ``static_input_scale``."""
        v = self.policy_version if weight_version is None else weight_version
        r = backend_recipe(self._served_config(), guided_layers=guided_layers(self.config, self.num_layers),
                           audit=self.module_audit(), weight_version=v, dtype=self._served_dtype())
        if self.kv_fp4:  # the engine's FP4 KV cache is SGLang's format, whatever the config says
            r = dataclasses.replace(r, kv_format=sglang_kvfp4.NAME)
        return dataclasses.replace(r, activation_amax=NATIVE_ACTIVATION_AMAX) if self.native else r

    def check_recipe(self, trainer: QuantRecipe, *, weight_version: int | None = None) -> None:
        """Raise ``RecipeMismatchError`` naming every field where ``trainer`` differs from what the engine serves.

        K/V: the engine's FP4 KV cache is ``sglang_kvfp4``; a trainer with another ``kv_format`` is refused
        unless ``accept_kv_format_mismatch`` (then ``kv_format`` is the one field allowed to differ)."""
        kv = [s for s in trainer.sites if s in KV_SITES]
        ignore = ()
        if kv and self.kv_fp4 and trainer.kv_format != sglang_kvfp4.NAME:
            msg = (f"KV cache format differs: kv_format: trainer={trainer.kv_format!r} sglang rollout="
                   f"{sglang_kvfp4.NAME!r} (sites: trainer={kv} as {trainer.kv_format} ({trainer.scale_rule}, RNE), "
                   f"sglang rollout={kv} as {sglang_kvfp4.NAME}: block 16, E8M0 ceil scales, ties away; "
                   "kv_cache_dtype=fp4_e2m1)")
            if not self.accept_kv_format_mismatch:
                raise RecipeMismatchError(msg + f"; set TraceConfig.kv_format={sglang_kvfp4.NAME!r} on the trainer "
                                          "(it then computes SGLang's K/V and is guided by the KV records), or pass "
                                          "accept_kv_format_mismatch=True to run with the trainer rejecting the KV "
                                          "records (counted) and rounding K/V itself")
            logger.warning("%s: accepted; KV records are tagged %r and rejected by the trainer", msg,
                           sglang_kvfp4.NAME)
            ignore = ("kv_format",)
        check_recipe(trainer, self.recipe(weight_version), what="sglang rollout", ignore=ignore)
        self.trainer_recipe = trainer

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutBatch:
        prompts = check_prompts(prompts, self.vocab_size)  # (the engine checks its context length itself)
        refuse_after_failed_update(self, "engine")
        if sampling.seed is not None and not self._seeded_engine():
            logger.warning("SamplingParams.seed=%d is ignored: SGLang samples with sampling_seed only when launched "
                           "with enable_deterministic_inference=True", sampling.seed)
        outs = self.engine.generate(input_ids=prompts, sampling_params=[sampling_dict(sampling, i)
                                                                        for i in range(len(prompts))],
                                    return_logprob=True, return_routed_experts=self.return_routing)
        self._check_outputs(outs)
        _check_stops(outs, sampling.stop_token_ids)
        payloads = self._read_out(prompts, outs) if self.specs else None
        return self._assemble(prompts, outs, payloads)

    def _seeded_engine(self) -> bool:
        """Whether the engine honours ``sampling_seed`` (unknown server args: assumed to)."""
        args = getattr(self.engine, "server_args", None)
        return bool(getattr(args, "enable_deterministic_inference", True))

    def _check_outputs(self, outs: list[dict]) -> None:
        """Refuse aborted requests and missing routing (neither may pass as a sample of the policy)."""
        for i, o in enumerate(outs):
            reason = o["meta_info"]["finish_reason"]
            if _finish_type(reason) not in ("stop", "length"):
                raise RuntimeError(f"SGLang request {i} finished with finish_reason={reason!r} (expected 'stop' or "
                                   f"'length'): it is not a complete sample; regenerate the batch")
            n = len(o["output_ids"])
            if self.return_routing and n and not o["meta_info"].get("routed_experts"):
                raise RuntimeError(f"SGLang request {i} returned no routed_experts, which TraceConfig.routing_replay="
                                   f"{self.config.routing_replay} or expert_fc2_in guidance needs: launch the engine "
                                   "with enable_return_routed_experts=True (trace_server_args sets it)")

    def _read_out(self, prompts: list[list[int]], outs: list[dict]) -> list[list[dict]]:
        """The records of the finished sequences, from their KV slots: prompt + response sent again as
        ``READOUT_PREFIX`` requests (one extend token each; the rest is a radix-cache hit)."""
        tag = uuid.uuid4().hex[:12]
        seqs = [p + list(o["output_ids"]) for p, o in zip(prompts, outs)]
        rids = [f"{READOUT_PREFIX}{tag}-{i}" for i in range(len(seqs))]
        back = self.engine.generate(input_ids=seqs, sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}]
                                    * len(seqs), rid=rids)
        return [[p for p in (o["meta_info"].get(INFO_KEY) or []) if p] for o in back]

    def _assemble(self, prompts: list[list[int]], outs: list[dict],
                  payloads: list[list[dict]] | None = None) -> RolloutBatch:
        b = len(prompts)
        resp = [list(o["output_ids"]) for o in outs]
        plens = torch.tensor([len(p) for p in prompts])
        rlens = torch.tensor([len(r) for r in resp])
        s = int((plens + rlens).max())
        tokens = torch.full((b, s), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(b, s)
        mask = torch.zeros(b, s, dtype=torch.bool)
        routing: dict[int, torch.Tensor] = {}
        for i, (p, r, o) in enumerate(zip(prompts, resp, outs)):
            meta = o["meta_info"]
            n = len(p) + len(r)
            tokens[i, :n] = torch.tensor(p + r)
            mask[i, len(p) : n] = True
            lp = [t[0] for t in meta["output_token_logprobs"]]
            logprobs[i, len(p) : n] = torch.tensor(lp, dtype=torch.float32)
            if meta.get("routed_experts"):
                r_all = decode_routing(meta["routed_experts"], n, self.num_layers)  # [n-1, L, k]
                for layer in range(self.num_layers):
                    t = routing.setdefault(layer, torch.zeros(b, s, r_all.shape[-1], dtype=torch.long))
                    t[i, : n - 1] = r_all[:, layer]
        bad = (~torch.isfinite(logprobs) & mask).any(1).nonzero().flatten().tolist()
        if bad:  # (the hf backend checks its logits the same way)
            raise NonFiniteError(f"SGLang returned NaN/Inf log-probs for {len(bad)} of {b} request(s) (first: "
                                 f"{bad[:8]}): non-finite activations or weights in the engine; nothing of this "
                                 "batch is returned (no tokens, log-probs or guidance)")
        guidance = {}
        if self.specs:
            guidance = assemble(payloads or [[] for _ in outs], self.specs, s, routing)
        finish = tuple(_finish_type(o["meta_info"]["finish_reason"]) for o in outs)  # (checked: "stop" or "length")
        return RolloutBatch(tokens=tokens, prompt_lens=plens, response_lens=rlens, response_mask=mask,
                            logprobs=logprobs, routing=routing, guidance=guidance,
                            policy_version=self.policy_version, pad_token_id=self.pad_token_id,
                            finish_reasons=finish)

    def update_weights(self, weights: Iterable[tuple[str, WeightValue]], *, version: int | None = None,
                       recipe: QuantRecipe | None = None, reset: bool = False) -> None:
        """HF-named BF16 tensors / NVFP4 expert weights -> the engine, in place (NCCL group if given).

        ``version``: strictly greater than ``policy_version`` (None: +1); ``reset=True``: any version, on purpose
        (``base.next_policy_version``). The version, the recipe and the tensors' formats (``engine_tensors``) are
        checked before anything goes to the engine (which loads in place: a refused update must not reach it). An
        update that fails inside the engine sets ``failed_update``; ``generate`` then refuses until updates that
        succeed have sent every tensor of the failed one again."""
        new_version = next_policy_version(self.policy_version, version, reset=reset)
        with recipe_kept_on_failure(self):
            if recipe is not None:
                self.check_recipe(recipe, weight_version=new_version)
            elif self.trainer_recipe is not None:
                raise RecipeMismatchError(f"update_weights to version {new_version} without the trainer's recipe "
                                          f"(pass recipe=trainer_recipe.with_weight_version({new_version}))")
            fp4 = set(self.moe_layers) - self.bf16_expert_layers if self.config.quantizes("weights") else ()
            named = engine_tensors(weight_pairs(weights), bf16_layers=self.bf16_expert_layers, fp4_layers=fp4)
            _check_finite(named)
            self._send(named, new_version)
        self.policy_version = new_version
        self._unsent -= {name for name, _ in named}
        if not self._unsent:
            self.failed_update = None

    def _send(self, named: list, version: int) -> None:
        """The checked tensors -> the engine. It loads in place and SGLang 0.5.10 has no rollback: a failure here
        may leave some tensors new, so ``failed_update`` is set and ``generate`` refuses until updates that succeed
        have sent all of them again."""
        try:
            if self.weights_group is not None:
                self.weights_group.send(named)
                return
            ok = self.engine.update_weights_from_tensor(named, load_format=WEIGHT_LOADER, flush_cache=True)
            if isinstance(ok, tuple) and ok and ok[0] is False:
                raise RuntimeError(f"update_weights_from_tensor failed: {ok}")
        except BaseException as e:
            self._unsent |= {name for name, _ in named}
            self.failed_update = (f"the weight update to version {version} failed in the engine "
                                  f"({type(e).__name__}: {e})")
            logger.error("%s: generate is refused until updates that succeed have sent its tensors again",
                         self.failed_update)
            raise


def _check_stops(outs: list[dict], stop_token_ids: Sequence[int]) -> None:
    """Refuse responses that SGLang ended at a token outside ``stop_token_ids`` (its ``finish_reason`` ``matched``):
    with stop tokens it also stops at the model's EOS ids, which the rollout protocol (and the hf backend) does not."""
    stops = set(stop_token_ids)
    for i, o in enumerate(outs):
        reason = o["meta_info"]["finish_reason"]
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if _finish_type(reason) != "stop" or matched is None:
            continue
        ids = matched if isinstance(matched, list) else [matched]
        if not all(is_int(t) and t in stops for t in ids):
            raise RuntimeError(f"SGLang request {i} stopped at {matched!r}, not one of SamplingParams.stop_token_ids="
                               f"{sorted(stops)}: with stop tokens SGLang 0.5.10 also stops at the model's EOS ids "
                               "(config / generation config / tokenizer); list them in stop_token_ids, or pass none "
                               "to generate max_new_tokens")


def _check_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse an update whose floating-point tensors, as the engine gets them (BF16 values after their cast, FP4 scales
    and global scales), hold NaN/Inf, naming them (one host sync per device), as the hf backend does: the engine loads
    whatever it is sent."""
    names = nonfinite_names((name, t, None) for name, t in named)
    if names:
        raise NonFiniteError(f"update_weights: {len(names)} tensor(s) hold NaN/Inf as the engine would load them "
                             f"(BF16 values beyond its range become Inf), e.g. {names[:3]}; nothing was sent")
