"""``SGLangRolloutBackend``: the rollout protocol (``generate``, ``update_weights``) on a running Engine."""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ...config import TraceConfig
from ...manifest import ModuleAudit, QuantRecipe, RecipeMismatchError, check_recipe
from ..audit import backend_recipe, sglang_module_audit, without_kv
from ..base import RolloutBatch, SamplingParams, WeightValue, check_prompts
from .capture import INFO_KEY
from .launch import WEIGHT_LOADER, guidance_specs
from .records import assemble
from .weights import WeightsUpdateGroup, engine_tensors

logger = logging.getLogger(__name__)


def sampling_dict(s: SamplingParams) -> dict:
    """Our SamplingParams as SGLang's sampling_params dict (stop tokens kept in the output)."""
    d = {"temperature": float(s.temperature), "top_p": float(s.top_p), "max_new_tokens": int(s.max_new_tokens),
         "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": False, "no_stop_trim": True}
    if s.seed is not None:
        d["sampling_seed"] = int(s.seed)
    return d


def decode_routing(b64: str, seq_len: int, num_layers: int) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 int32 [seqlen-1, layers, topk]) -> int64 [seqlen-1, layers, topk]."""
    a = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    return torch.from_numpy(a.copy()).long().reshape(seq_len - 1, num_layers, -1)


class SGLangRolloutBackend:
    """Rollout through an SGLang Engine started with ``launch.make_engine(**trace_server_args(...))``.

    ``exclude_modules``: the checkpoint's ModelOpt ``exclude_modules`` (None: every non-expert
    module excluded, as ``export.modelopt`` writes); ``recipe``: the trainer's ``QuantRecipe``,
    checked now and required on every ``update_weights`` (as in the hf backend).
    """

    def __init__(self, engine, trace_config: TraceConfig, hf_config: dict, *, pad_token_id: int = 0,
                 weights_group: WeightsUpdateGroup | None = None, exclude_modules: list[str] | None = None,
                 recipe: QuantRecipe | None = None):
        self.engine, self.config, self.hf_config = engine, trace_config, hf_config
        self.exclude_modules = None if exclude_modules is None else list(exclude_modules)
        self.num_layers = int(hf_config["num_hidden_layers"])
        self.vocab_size = int(hf_config["vocab_size"])
        self.specs = guidance_specs(trace_config, hf_config)
        self.pad_token_id = pad_token_id
        self.weights_group = weights_group
        self.policy_version = 0
        self.trainer_recipe: QuantRecipe | None = None
        if recipe is not None:
            self.check_recipe(recipe)

    # ---- manifest -----------------------------------------------------------------------------
    def module_audit(self) -> ModuleAudit:
        """What the engine serves in FP4 (experts + any Linear the exclude patterns miss) vs BF16."""
        return sglang_module_audit(self.config, self.hf_config, self.exclude_modules)

    def recipe(self, weight_version: int | None = None) -> QuantRecipe:
        """The recipe this engine serves: the TraceConfig without KV sites (its KV cache stays BF16)."""
        v = self.policy_version if weight_version is None else weight_version
        return backend_recipe(without_kv(self.config), guided_layers={s.layer for s in self.specs},
                              audit=self.module_audit(), weight_version=v)

    def check_recipe(self, trainer: QuantRecipe, *, weight_version: int | None = None) -> None:
        check_recipe(trainer, self.recipe(weight_version), what="sglang rollout")
        self.trainer_recipe = trainer

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutBatch:
        check_prompts(prompts, self.vocab_size)
        prompts = [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in prompts]
        outs = self.engine.generate(input_ids=prompts, sampling_params=[sampling_dict(sampling)] * len(prompts),
                                    return_logprob=True, return_routed_experts=self.config.routing_replay)
        return self._assemble(prompts, outs)

    def _assemble(self, prompts: list[list[int]], outs: list[dict]) -> RolloutBatch:
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
        guidance = {}
        if self.specs:
            payloads = [o["meta_info"].get(INFO_KEY) or [] for o in outs]
            guidance = assemble(payloads, self.specs, s, routing)
        finish = tuple("stop" if o["meta_info"]["finish_reason"]["type"] == "stop" else "length" for o in outs)
        return RolloutBatch(tokens=tokens, prompt_lens=plens, response_lens=rlens, response_mask=mask,
                            logprobs=logprobs, routing=routing, guidance=guidance,
                            policy_version=self.policy_version, pad_token_id=self.pad_token_id,
                            finish_reasons=finish)

    def update_weights(self, weights: Iterable[tuple[str, WeightValue]], *, version: int | None = None,
                       recipe: QuantRecipe | None = None) -> None:
        """HF-named BF16 tensors / NVFP4 expert weights -> the engine, in place (NCCL group if given)."""
        new_version = self.policy_version + 1 if version is None else int(version)
        if recipe is not None:
            self.check_recipe(recipe, weight_version=new_version)
        elif self.trainer_recipe is not None:
            raise RecipeMismatchError(f"update_weights to version {new_version} without the trainer's recipe "
                                      f"(pass recipe=trainer_recipe.with_weight_version({new_version}))")
        named = engine_tensors(weights)
        if self.weights_group is not None:
            self.weights_group.send(named)
        else:
            ok = self.engine.update_weights_from_tensor(named, load_format=WEIGHT_LOADER, flush_cache=True)
            if isinstance(ok, tuple) and ok and ok[0] is False:
                raise RuntimeError(f"update_weights_from_tensor failed: {ok}")
        self.policy_version = new_version
