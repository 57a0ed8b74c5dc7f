"""Megatron GPTModel (local spec) <-> HF Qwen3-MoE weights, through mbridge.

mbridge 0.15.1 (pure Python; ``pip install --no-deps mbridge==0.15.1``) holds the name and
layout map (fused QKV interleaved per KV group, fc1 = [gate; up], per-expert HF names), the
lazy per-tensor safetensors reads and the EP/TP gather on export. Its stock Qwen3-MoE bridge
assumes the Transformer Engine spec and an older transformers; ``Qwen3MoeBridge`` adapts it:
  - the config comes from ``transformer_config_from_hf`` (router settings per norm_topk_prob);
  - the layer spec is Megatron's local spec, whose parameter names are renamed to the TE names
    mbridge's tables use (``input_layernorm`` -> ``linear_qkv.layer_norm_weight``,
    ``experts.local_experts.i.linear_fc1.weight`` -> ``experts.linear_fc1.weight{i}``);
  - expert parallelism: EP rank r owns experts [r*E/ep, (r+1)*E/ep) and reads only those;
  - RoPE theta from ``rope_parameters`` (transformers >= 5);
  - reads are counted (``last_load_stats``) so a rank's I/O can be checked against its shard.
Tensor parallelism goes through mbridge's TP split/merge but is not tested here yet.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .config import gpt_model_kwargs, local_layer_spec, transformer_config_from_hf

logger = logging.getLogger(__name__)

try:
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.models.qwen3moe import Qwen3MoEBridge as _MBridgeQwen3MoE
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("megatron_trace.bridge needs mbridge: pip install --no-deps mbridge==0.15.1") from e


@dataclass
class LoadStats:
    """What one rank read from the checkpoint."""

    tensors: int = 0
    bytes: int = 0


class _CountingSafeTensorIO(SafeTensorIO):
    def __init__(self, hf_dir: str, stats: LoadStats):
        super().__init__(hf_dir)
        self.stats = stats

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        out = super().load_some_hf_weight(hf_weight_names)
        self.stats.tensors += len(out)
        self.stats.bytes += sum(t.numel() * t.element_size() for t in out.values())
        return out


_LOCAL_TO_TE = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".mlp.experts.\2.weight\1"),
)
_TE_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


class Qwen3MoeBridge(_MBridgeQwen3MoE):
    """mbridge's Qwen3-MoE bridge for Megatron's local spec on any device (see the module docstring).

    hf_config: a transformers ``Qwen3MoeConfig``. dtype: Megatron parameter dtype.
    config_overrides: passed to ``transformer_config_from_hf``.
    """

    def __init__(self, hf_config, dtype: torch.dtype = torch.bfloat16, parallel_states=None, **config_overrides):
        self._config_overrides = dict(config_overrides)
        super().__init__(hf_config, dtype=dtype, parallel_states=parallel_states)
        self.last_load_stats = LoadStats()

    # ---- model construction -------------------------------------------------------------------
    def _build_config(self):
        kw = {**self._config_overrides, **self.extra_args}
        return transformer_config_from_hf(
            self.hf_config, dtype=self.dtype, tensor_parallel=self.mpu.tp_size, expert_parallel=self.mpu.ep_size, **kw
        )

    def _get_transformer_layer_spec(self, vp_stage=None):
        self.has_vp_stage = False
        return local_layer_spec(self.hf_config)

    def _get_gptmodel_args(self) -> dict:
        kw = gpt_model_kwargs(self.hf_config)
        kw.pop("share_embeddings_and_output_weights")  # mbridge's provider passes it itself
        return kw

    def build_model(self, pre_process: bool = True, post_process: bool = True):
        """A randomly initialised GPTModel on the current device (no ``.cuda()``, no DDP wrap)."""
        return self._model_provider([])(pre_process, post_process)

    # ---- names ------------------------------------------------------------------------------
    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        ret = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        per_rank = self.config.num_moe_experts // self.mpu.ep_size
        for local, name in ret.items():
            for pattern, repl in _LOCAL_TO_TE:
                name = pattern.sub(repl, name)
            m = _TE_EXPERT.match(name)
            if m and consider_ep and self.mpu.ep_size > 1:
                name = f"{m.group(1)}{int(m.group(2)) + per_rank * self.mpu.ep_rank}"
            ret[local] = name
        return ret

    # ---- I/O --------------------------------------------------------------------------------
    def _get_safetensor_io(self, weights_path: str):
        self.last_load_stats = LoadStats()
        return _CountingSafeTensorIO(self._get_actual_hf_path(weights_path), self.last_load_stats)

    def _get_actual_hf_path(self, weight_path: str) -> str:
        if not os.path.isfile(os.path.join(weight_path, "config.json")):
            raise FileNotFoundError(f"{weight_path!r} is not a HF checkpoint directory (no config.json); "
                                    "this bridge never downloads")
        return weight_path

    def local_hf_names(self, model) -> list[str]:
        """The HF tensor names this rank's model parameters are built from."""
        mapping = self._weight_name_mapping_mcore_local_to_global(model)
        return [n for k, v in mapping.items() if "_extra_state" not in k
                for n in self._weight_name_mapping_mcore_to_hf(v)]


def _as_list(models) -> list:
    return list(models) if isinstance(models, list | tuple) else [models]


def load_hf_checkpoint(models, path: str | os.PathLike, bridge: Qwen3MoeBridge, *, memory_efficient: bool = False
                       ) -> LoadStats:
    """Load a HF safetensors checkpoint directory into this rank's model(s), in place.

    Each rank reads only the tensors its parameters need (its own experts under EP), lazily
    per tensor; ``memory_efficient`` reads one tensor at a time instead of the rank's whole shard.
    """
    with torch.no_grad():
        bridge.load_weights(_as_list(models), os.fspath(path), memory_efficient=memory_efficient)
    logger.info("loaded %d tensors (%.1f MB) from %s", bridge.last_load_stats.tensors,
                bridge.last_load_stats.bytes / 1e6, path)
    return bridge.last_load_stats


def export_hf_weights(models, bridge: Qwen3MoeBridge) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF checkpoint name, tensor) for the whole model; every rank must iterate (collectives)."""
    with torch.no_grad():
        yield from bridge.export_weights(_as_list(models))


def save_hf_checkpoint(models, path: str | os.PathLike, bridge: Qwen3MoeBridge) -> None:
    """Write a HF checkpoint directory (safetensors + config.json) from rank 0; all ranks must call."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().cpu().clone() for name, t in export_hf_weights(models, bridge)}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        bridge.hf_config.save_pretrained(path)
