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
  - reads are counted (``last_load_stats``) so a rank's I/O can be checked against its shard;
  - ``load_weights``/``export_weights`` are our own loops: mbridge 0.15.1 picks the expert-TP
    group by the TE grouped-expert name, which local-spec names never match, so under TP > 1 it
    would split experts over the attention TP group. Here every parameter is scattered/gathered
    over the group that shards it (ETP for experts, TP otherwise), reusing mbridge's name/layout
    maps and its ``_weight_split_across_tp``/``_weight_merge_across_tp``. Pipeline parallelism
    is not supported (clear error).
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open

from ..rollout.hf_weights import parse_expert_name
from .agree import agree, agreed
from .config import check_checkpoint_config, gpt_model_kwargs, local_layer_spec, transformer_config_from_hf
from .params import exported_tensors, gather_params, refuse_sharded

logger = logging.getLogger(__name__)

try:
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.core.util import unwrap_model
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
        self._check_in_index(hf_weight_names)
        out = super().load_some_hf_weight(hf_weight_names)
        _refuse_unmapped({n: t.dtype for n, t in out.items() if not t.is_floating_point() or t.element_size() < 2})
        self.stats.tensors += len(out)
        self.stats.bytes += sum(t.numel() * t.element_size() for t in out.values())
        return out

    def _check_in_index(self, hf_weight_names: list[str]) -> None:
        absent = [n for n in hf_weight_names if self.index and n not in self.index]
        if absent:
            raise ValueError(f"{len(absent)} tensor(s) the model needs are not in {self.hf_dir}'s "
                             f"model.safetensors.index.json, e.g. {absent[:3]}: does config.json match the checkpoint?")

    def headers(self, hf_weight_names: list[str]) -> dict[str, tuple[list[int], str]]:
        """(shape, safetensors dtype, e.g. "BF16") of each named tensor, from the file headers (no data read)."""
        if self.index:
            self._check_in_index(hf_weight_names)
            files = sorted({self.index[n] for n in hf_weight_names})
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.hf_dir, "*.safetensors")))
        wanted, out = set(hf_weight_names), {}
        for fname in files:
            with safe_open(os.path.join(self.hf_dir, fname), framework="pt", device="cpu") as f:
                for n in wanted.intersection(f.keys()):
                    sl = f.get_slice(n)
                    out[n] = (sl.get_shape(), sl.get_dtype())
        absent = sorted(wanted - out.keys())
        if absent:
            raise ValueError(f"{len(absent)} tensor(s) the model needs are in no safetensors file of {self.hf_dir}, "
                             f"e.g. {absent[:3]}: does config.json match the checkpoint?")
        unmapped = {n: _OTHER_DTYPES.get(d, d) for n, (_, d) in out.items() if d not in _FLOAT_DTYPES}
        _refuse_unmapped(unmapped)
        return out

    def load_hf_weight_names(self) -> list[str]:
        """The checkpoint's tensor names; without an index, a name in two ``*.safetensors`` files is refused (which
        copy a load would take depends on the directory listing: e.g. a stray shard of an earlier save)."""
        if self.index:
            return list(self.index)
        where: dict[str, list[str]] = {}
        for path in sorted(glob.glob(os.path.join(self.hf_dir, "*.safetensors"))):
            with safe_open(path, framework="pt", device="cpu") as f:
                for n in f.keys():
                    where.setdefault(n, []).append(os.path.basename(path))
        twice = {n: files for n, files in where.items() if len(files) > 1}
        if twice:
            n = next(iter(twice))
            raise ValueError(f"{len(twice)} tensor(s) are in more than one safetensors file of {self.hf_dir} and "
                             f"there is no model.safetensors.index.json to say which to use, e.g. {n!r} in "
                             f"{twice[n]}: remove the stray file(s) or add the index")
        return list(where)


_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}

_OTHER_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I8": torch.int8, "U8": torch.uint8,
                 "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def _refuse_unmapped(unmapped: dict) -> None:
    """A quantized checkpoint (FP8 with ``*_scale_inv``, ...): its values are not the weights."""
    if unmapped:
        dtypes = sorted(set(map(str, unmapped.values())))
        raise ValueError(f"{len(unmapped)} checkpoint tensor(s) of dtypes {dtypes}, e.g. {next(iter(unmapped))}: "
                         "only bf16 / fp16 / fp32 checkpoints are mapped")


_LOCAL_TO_TE = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".mlp.experts.\2.weight\1"),
)
_TE_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def _check_cast_fits(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise if casting checkpoint tensor ``t`` to the parameters' ``dtype`` turns finite values into Inf (an fp32 or
    bf16 checkpoint loaded into float16, whose largest value is 65504): the model would run on Inf silently."""
    if not t.is_floating_point() or torch.finfo(dtype).max >= torch.finfo(t.dtype).max:
        return
    over = torch.isinf(t.to(dtype)) & torch.isfinite(t)
    if bool(over.any()):
        big = float(t[over].abs().max())
        raise ValueError(f"{name}: {int(over.sum())} value(s) (|x| up to {big:g}) overflow the bridge's dtype={dtype} "
                         f"(largest finite {torch.finfo(dtype).max:g}); build the bridge in torch.bfloat16 or "
                         "torch.float32")


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

    # ---- parallel layout ----------------------------------------------------------------------
    def _shard_group(self, global_name: str) -> tuple:
        """(group, size, rank) a parameter is tensor-sharded over: ETP for experts, TP otherwise."""
        if _TE_EXPERT.match(global_name):
            return self.mpu.etp_group, self.mpu.etp_size, self.mpu.etp_rank
        return self.mpu.tp_group, self.mpu.tp_size, self.mpu.tp_rank

    def _require_no_pipeline(self) -> None:
        if self.mpu.pp_size > 1:
            raise NotImplementedError(f"Qwen3MoeBridge supports pipeline parallel size 1 only, got {self.mpu.pp_size}")

    def load_weights(self, models: list, weights_path: str, memory_efficient: bool = False) -> None:
        """Fill this rank's parameters from a HF checkpoint; rank 0 of each shard group reads and scatters.

        Under TP, ETP or EP > 1 every rank must call it: the ranks check what they read (tensor names, dtypes and
        shapes from the file headers) and agree before the first scatter, so a checkpoint one rank refuses raises on
        every rank (a ``ValueError`` naming the refusing rank and its reason) instead of leaving the others waiting in
        the scatter until the process group's timeout. A failure after the checks (an I/O error mid-read, an
        out-of-memory copy) does not stop the failing rank's scatters: it reads nothing more, sends its partners
        placeholders, and the ranks agree once more at the end, where the others raise a ``RuntimeError`` naming it
        and its cause (the model is then partly loaded on every rank)."""
        self._require_no_pipeline()
        try:
            self.safetensor_io, refused = self._get_safetensor_io(weights_path), None
        except Exception as e:  # (e.g. a directory this rank's node lacks) raised in the first check, agreed on
            refused = e
        for model in models:
            self._load_model(unwrap_model(model), memory_efficient, weights_path, refused)

    def _load_model(self, model, memory_efficient: bool, where: str, refused: Exception | None = None) -> None:
        refuse_sharded(model)
        params = model.state_dict()  # (detached: no Megatron attributes, hence split_dims)
        split_dims = {k: p.partition_dim for k, p in model.named_parameters()
                      if getattr(p, "tensor_model_parallel", False)}
        plan = [(local, name, self._weight_name_mapping_mcore_to_hf(name), self._shard_group(name))
                for local, name in self._weight_name_mapping_mcore_local_to_global(model).items()
                if "_extra_state" not in local]
        readers = [hf for _, _, hf, (_, _, rank) in plan if rank == 0]

        def check_and_read() -> dict:
            if refused is not None:
                raise refused
            self._check_all_consumed({n for _, _, hf, _ in plan for n in hf})
            self._check_shapes(plan, params, split_dims)
            self._check_config(where)
            return {} if memory_efficient else self.safetensor_io.load_some_hf_weight([n for hf in readers for n in hf])

        split = self.mpu.ep_size > 1 or any(size > 1 for *_, (_, size, _) in plan)  # every rank loads its part
        if not split:
            self._fill(plan, params, check_and_read(), split)
            return
        cache = agreed(check_and_read, f"refused to load the checkpoint {where}")
        agree(self._fill(plan, params, cache, split), f"failed to load the checkpoint {where} after the checks passed",
               RuntimeError)

    def _fill(self, plan: list, params: dict, cache: dict, split: bool) -> Exception | None:
        """Copy each parameter in, scattered from rank 0 of its shard group. Under ``split`` a failure is returned,
        not raised: the rank stops reading but keeps joining the scatters (its partners wait in them otherwise)."""
        error = None
        for local, name, hf_names, (group, size, rank) in plan:
            param = params[local]
            shards = None
            if error is None:
                try:
                    if rank == 0:
                        shards = self._read_shards(name, hf_names, param, size, cache)
                    if size == 1:
                        param.copy_(shards[0])
                except Exception as e:  # agreed on by the caller
                    if not split:
                        raise
                    error = e
                    cache.clear()
                    logger.error("loading %s from %s failed (%s: %s); joining the remaining scatters without reading "
                                 "so that every rank learns of it", local, self.safetensor_io.hf_dir,
                                 type(e).__name__, e)
            if size == 1:
                continue
            mine = torch.empty_like(param)
            if rank == 0 and shards is None:  # failed: the partners get placeholders, and the error at the end
                shards = [mine] * size
            dist.scatter(mine, shards, src=dist.get_global_rank(group, 0), group=group)
            if error is None:
                param.copy_(mine)
        return error

    def _read_shards(self, name: str, hf_names: list[str], param: torch.Tensor, size: int, cache: dict) -> list:
        """The ``size`` shards of one parameter, from the cache or read now, on the parameter's device and dtype."""
        hf = [cache.pop(n) if n in cache else self.safetensor_io.load_one_hf_weight(n) for n in hf_names]
        for n, t in zip(hf_names, hf):
            _check_cast_fits(n, t, param.dtype)
        return [t.to(param.device, param.dtype).contiguous()
                for t in self._weight_split_across_tp(name, self._weight_to_mcore_format(name, hf), param, size)]

    def _check_shapes(self, plan: list, params: dict, split_dims: dict[str, int]) -> None:
        """The tensors this rank reads exist, are floating, and convert to its parameters' shapes: the conversion
        and TP split run on meta tensors of the header shapes (no data is read). A split parameter's whole converted
        weight is checked too, against the parameter's shape times the split size on its ``partition_dim``: mbridge's
        split copies a weight already of one rank's shape to every rank (e.g. an o_proj of one TP rank's columns)."""
        mine = [(local, name, hf_names, size) for local, name, hf_names, (_, size, rank) in plan if rank == 0]
        headers = self.safetensor_io.headers([n for _, _, hf_names, _ in mine for n in hf_names])
        for local, name, hf_names, size in mine:
            param = params[local]
            shapes = [tuple(headers[n][0]) for n in hf_names]
            meta = [torch.empty(shape, dtype=_FLOAT_DTYPES[headers[n][1]], device="meta")
                    for n, shape in zip(hf_names, shapes)]
            want = _whole_shape(param.shape, split_dims.get(local), size)
            try:
                whole = self._weight_to_mcore_format(name, meta)
                got = tuple(self._weight_split_across_tp(name, whole, param.to("meta"), size)[0].shape)
                whole = tuple(whole.shape)
            except (AssertionError, RuntimeError, ValueError) as e:  # mbridge's reshapes of a wrong shape
                whole = got = f"no per-rank shape ({type(e).__name__}: {e})"
            if got != tuple(param.shape) or whole != want:
                found, expected = f"{got} per rank", tuple(param.shape)
                if want != expected:  # split: the whole shapes say what is wrong
                    found = found if isinstance(whole, str) else f"{whole} whole ({found})"
                    expected = f"{want} whole ({expected} on each of {size} ranks)"
                raise ValueError(f"{hf_names} -> {local}: the checkpoint's shape {shapes} gives {found}, the "
                                 f"model's is {expected}; does config.json match the checkpoint?")

    def _check_config(self, where: str) -> None:
        """The bridge's ``hf_config`` computes what the checkpoint's config.json says (``check_checkpoint_config``:
        the fields the shape checks cannot see, e.g. top-k)."""
        from transformers import AutoConfig

        hf_dir = self.safetensor_io.hf_dir
        check_checkpoint_config(self.hf_config, AutoConfig.from_pretrained(hf_dir), hf_dir)

    def _check_all_consumed(self, wanted: set[str]) -> None:
        """Every checkpoint tensor is one this rank reads, another EP rank's expert, or a tied ``lm_head``: a tensor
        nothing maps (a bias, an extra layer, a quantization scale) would otherwise be dropped without a word."""
        c, tied = self.config, bool(getattr(self.hf_config, "tie_word_embeddings", False))
        names = self.safetensor_io.load_hf_weight_names()
        if tied and "lm_head.weight" in names:
            self._check_tied_lm_head()
        left = []
        for n in names:
            if n in wanted or (tied and n == "lm_head.weight"):
                continue
            e = parse_expert_name(n)
            if e and self.mpu.ep_size > 1 and e[0] < c.num_layers and e[1] < c.num_moe_experts:
                continue  # another EP rank's
            left.append(n)
        if left:
            raise ValueError(f"{len(left)} checkpoint tensor(s) map to no parameter of this model, e.g. {left[:4]}: "
                             "a config.json with fewer layers or experts than the weights, or weights this bridge does "
                             "not map (biases, quantization scales)")

    def _check_tied_lm_head(self) -> None:
        """With ``tie_word_embeddings`` the output layer is the embedding: a checkpoint ``lm_head.weight`` must equal
        ``model.embed_tokens.weight`` (transformers unties the two when they differ, and the rollout would compute
        with another output layer than the trainer)."""
        pair = SafeTensorIO.load_some_hf_weight(self.safetensor_io, ["lm_head.weight", "model.embed_tokens.weight"])
        head, embed = pair["lm_head.weight"], pair["model.embed_tokens.weight"]
        if head.shape != embed.shape or not torch.equal(head.to(embed.dtype), embed):
            raise ValueError(f"config.json has tie_word_embeddings=True but the checkpoint's lm_head.weight "
                             f"{tuple(head.shape)} differs from model.embed_tokens.weight {tuple(embed.shape)}: "
                             "transformers unties them and this bridge would tie them; set tie_word_embeddings=false "
                             "in config.json if the checkpoint's lm_head is its own")

    def export_weights(self, models: list) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor in the bridge's dtype) for the whole model; every rank must iterate
        (collectives). (Megatron's torch RMSNorm keeps fp32 weights in a bf16 model: a bf16 checkpoint's norms come
        back bf16, the values they were loaded from.)

        The tensors are detached (no ``requires_grad``), and one that needs no gather or cast is a view of the
        parameter itself: it follows the model's next update, so a consumer that keeps tensors past it (an async
        sync queue) copies them, and one that writes into them writes into the model."""
        for name, t in self._export_weights(models):
            t = t.detach()
            yield name, t.to(self.dtype) if t.is_floating_point() else t

    def _export_weights(self, models: list) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_no_pipeline()
        for model in models:
            gather_params(model)
            model = unwrap_model(model)
            mapping = self._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            for local, tensor in exported_tensors(model):
                name = mapping[local]
                if _TE_EXPERT.match(name):
                    yield from self._export_expert(name, tensor)
                    continue
                full = self._gather_shards(name, tensor) if getattr(tensor, "tensor_model_parallel", False) else tensor
                yield from zip(*self._weight_to_hf_format(name, full))

    def _gather_shards(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        group, size, _ = self._shard_group(name)
        if size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        if _TE_EXPERT.match(name):  # over ETP (mbridge's merge follows the TP size: with TP 1 it takes one part)
            if ".linear_fc1." in name:  # each part is [gate rows; up rows]
                halves = [p.chunk(2) for p in parts]
                return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            return torch.cat(parts, dim=1)  # fc2: split along its input
        return self._weight_merge_across_tp(name, parts, tensor)

    def _export_expert(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """One local expert's weight -> the same local slot of every EP rank, under global expert ids."""
        m = _TE_EXPERT.match(name)
        per_rank = self.config.num_moe_experts // self.mpu.ep_size
        if self.mpu.ep_size > 1:
            per_ep_rank = [torch.empty_like(tensor) for _ in range(self.mpu.ep_size)]
            dist.all_gather(per_ep_rank, tensor.contiguous(), group=self.mpu.ep_group)
        else:
            per_ep_rank = [tensor]
        for ep_rank, shard in enumerate(per_ep_rank):
            global_name = f"{m.group(1)}{int(m.group(2)) + per_rank * ep_rank}"
            yield from zip(*self._weight_to_hf_format(global_name, self._gather_shards(global_name, shard)))

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


def _whole_shape(shape: torch.Size, partition_dim: int | None, size: int) -> tuple[int, ...]:
    """The shape of the whole weight a parameter of ``shape`` is one of ``size`` shards of (split on
    ``partition_dim``; None: not split, every rank holds it whole)."""
    whole = list(shape)
    if partition_dim is not None:
        whole[partition_dim] *= size
    return tuple(whole)
