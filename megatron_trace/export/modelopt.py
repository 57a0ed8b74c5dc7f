"""Export a trained policy as a ModelOpt-style NVFP4 checkpoint (SGLang/vLLM/TRT-LLM ``modelopt_fp4``).

Routed-expert Linear modules are stored quantized; everything else stays BF16 and is listed in
``exclude_modules``. Per quantized Linear ``<prefix>`` (e.g. ``model.layers.0.mlp.experts.3.gate_proj``),
as SGLang 0.5.10's ``ModelOptFp4LinearMethod`` / ``ModelOptNvFp4FusedMoEMethod`` load them:

  <prefix>.weight          uint8 [N, K/2]           packed E2M1, element 2i in the low nibble
  <prefix>.weight_scale    float8_e4m3fn [N, K/16]  block scales (linear layout, not swizzled)
  <prefix>.weight_scale_2  float32 []               decode scale  = weight amax / (6 * 448) (fp32(1 / FLT_MAX) for an
                                                    amax below 2688 / FLT_MAX, where our S_enc saturates)
  <prefix>.input_scale     float32 []               static activation decode scale = act amax / (6 * 448)

``hf_quant_config.json``: ``{"producer": ..., "quantization": {"quant_algo": "NVFP4", "group_size": 16,
"kv_cache_quant_algo": null, "exclude_modules": [...]}}``. With ``trace_extras=True`` each quantized
Linear also gets ``<prefix>.weight_global_amax`` (float32 [], the exact amax: ``weight_scale_2 * 2688``
does not always round-trip in fp32) which the TRACE SGLang method loads and stock loaders ignore.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from ..config import TraceConfig
from ..formats import NVFP4_BLOCK, FP4Tensor, NonFiniteError
from ..formats.nvfp4 import decode_scale_from_amax
from ..manifest import excluded_modules, experts_name, module_excluded
from ..rollout.audit import SGLANG_PACKED
from ..rollout.base import nonfinite_names
from ..rollout.checkpoint_dir import StagedCheckpointDir
from ..rollout.hf_weights import INDEX_FILE, WEIGHTS_FILE, ShardedSafetensorsWriter, join_fc1, parse_expert_name

logger = logging.getLogger(__name__)

QUANT_CONFIG_FILE = "hf_quant_config.json"
PRODUCER = {"name": "megatron_trace", "version": "0.1.0"}
BF16_DTYPE = torch.bfloat16
"""The dtype of the unquantized tensors of a ``save_modelopt_checkpoint`` (and its config.json's ``dtype``)."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def modelopt_linear_tensors(prefix: str, q: FP4Tensor, input_amax: float | torch.Tensor,
                            *, trace_extras: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one NVFP4 Linear ``prefix`` from its FP4 weight [N, K]."""
    if q.fmt != "nvfp4":
        raise ValueError(f"{prefix}: ModelOpt NVFP4 export needs fmt='nvfp4', got {q.fmt!r}")
    if q.codes.dim() != 2:
        raise ValueError(f"{prefix}: expected a 2-D weight [N, K], got shape {q.shape}")
    if q.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"{prefix}: K={q.shape[-1]} must be a multiple of {NVFP4_BLOCK} for ModelOpt NVFP4")
    if q.global_amax is None or q.global_amax.dim() != 0:
        raise ValueError(f"{prefix}: ModelOpt stores one weight_scale_2 per Linear: the FP4 weight needs a per-tensor "
                         f"global_amax (shape []), got {None if q.global_amax is None else tuple(q.global_amax.shape)}")
    n, k = q.shape
    for field, dtype, shape in (("codes", torch.uint8, (n, k // 2)),
                                ("block_scales", torch.float8_e4m3fn, (n, k // NVFP4_BLOCK))):
        t = getattr(q, field)  # (a uint8 view of the scales would be stored as U8, read as numbers)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{prefix}: {field} must be {dtype} {list(shape)} for an NVFP4 weight of shape "
                             f"{tuple(q.shape)}, got {t.dtype} {list(t.shape)}")
    sf = q.block_scales.float()  # (e4m3fn has NaN, no Inf; a sign bit decodes as a negative scale)
    if not bool((torch.isfinite(sf) & (sf >= 0)).all()):
        bad = sf[~(torch.isfinite(sf) & (sf >= 0))]
        raise ValueError(f"{prefix}: block_scales must be finite and >= 0 (an engine decodes codes * scale as they "
                         f"are), got {bad.numel()} other(s), e.g. {bad[:4].tolist()}")
    if not bool(torch.isfinite(q.global_amax)) or float(q.global_amax) < 0:
        raise ValueError(f"{prefix}: global_amax={float(q.global_amax)} must be finite and >= 0")
    try:
        if isinstance(input_amax, bool):  # (True was an amax of 1.0)
            raise TypeError("a bool")
        a = torch.as_tensor(input_amax, dtype=torch.float32).reshape(())
    except (TypeError, ValueError, RuntimeError) as e:  # (a per-row amax tensor, None, a string)
        got = f"shape {tuple(input_amax.shape)}" if isinstance(input_amax, torch.Tensor) else repr(input_amax)[:80]
        raise ValueError(f"{prefix}: input_amax must be one number (the static activation amax of the Linear's "
                         f"input, e.g. the largest per-row amax recorded), got {got}") from e
    if not bool(torch.isfinite(a)) or float(a) <= 0:
        raise ValueError(f"{prefix}: input_amax={float(a)} must be finite and > 0 (the static activation amax)")
    out = {
        f"{prefix}.weight": q.codes.contiguous(),
        f"{prefix}.weight_scale": q.block_scales.contiguous(),
        f"{prefix}.weight_scale_2": decode_scale_from_amax(q.global_amax).reshape(()).clone(),
        f"{prefix}.input_scale": decode_scale_from_amax(a).reshape(()).clone(),
    }
    if trace_extras:
        out[f"{prefix}.weight_global_amax"] = q.global_amax.float().reshape(()).clone()
    return out


def fp4_from_modelopt(tensors: Mapping[str, torch.Tensor], prefix: str, k: int | None = None) -> FP4Tensor:
    """Read one quantized Linear back as an ``FP4Tensor`` (amax exact when ``weight_global_amax`` is there)."""
    codes = tensors[f"{prefix}.weight"]
    amax = tensors.get(f"{prefix}.weight_global_amax")
    if amax is None:
        amax = tensors[f"{prefix}.weight_scale_2"].float() * (6.0 * 448.0)
    t = FP4Tensor(codes=codes, block_scales=tensors[f"{prefix}.weight_scale"], global_amax=amax.float().reshape(()),
                  shape=(codes.shape[0], k if k is not None else codes.shape[1] * 2), fmt="nvfp4")
    try:  # (k=200 over 64 coded columns, or scales of other rows, dequantized as the coded ones)
        t.check_layout()
    except ValueError as e:
        raise ValueError(f"{prefix}: {e}") from None
    return t


def _expert_prefix(name: str) -> str:
    return name.removesuffix(".weight")


def exclude_modules_of(bf16_names: Iterable[str]) -> list[str]:
    """Module names of the BF16 Linear weights (2-D ``*.weight`` outside the routed experts), sorted, plus the fused
    Linear SGLang builds from shards that are all BF16 (``self_attn.qkv_proj``, ``mlp.gate_up_proj``): SGLang 0.5.10's
    Qwen2-MoE has no packed_modules_mapping, so ``is_layer_skipped`` tests the entries against the fused prefix and
    a ``q_proj`` entry alone leaves ``qkv_proj`` quantized (``rollout.audit.sglang_excluded``)."""
    names = {n.removesuffix(".weight") for n in bf16_names if n.endswith(".weight")}
    fused = set()
    for name in names:
        parent, proj = name.rsplit(".", 1) if "." in name else ("", name)
        for packed, shards in SGLANG_PACKED.items():
            if proj in shards and all(f"{parent}.{s}" in names for s in shards):
                fused.add(f"{parent}.{packed}")
    return sorted(names | fused)


def build_modelopt_state(
    named: Iterable[tuple[str, torch.Tensor | FP4Tensor]],
    input_amax: Mapping[str, float] | float,
    *,
    trace_extras: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    trace_config: TraceConfig | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Checkpoint tensors and ``exclude_modules`` from HF-named weights.

    Routed-expert weights must be ``FP4Tensor`` (e.g. ``bridge.fp4_stream``: gate/up halves sharing one
    amax), except those of layers ``trace_config.exclude_modules`` keeps in BF16 (``fp4_stream(...,
    bf16_layers=...)``), which are tensors and listed as excluded (``model.layers.L.mlp.experts``); everything
    else a tensor (stored in ``dtype`` if floating). ``input_amax``: the static activation amax per expert
    Linear prefix (``model.layers.L.mlp.experts.E.gate_proj``; a key that names no exported FP4 Linear is refused)
    or one float for all (e.g. the largest per-row amax the rollout recorded). The whole state in memory:
    ``save_modelopt_checkpoint`` streams it instead.
    """
    exclude: list[str] = []
    _check_exported_config(trace_config)
    state = dict(_modelopt_tensors(named, input_amax, trace_extras, dtype, trace_config, exclude))
    return state, exclude


def _check_exported_config(trace_config: TraceConfig | None) -> None:
    """The trainer's config must fake-quantize its routed experts' weights as this export stores them: NVFP4 (an MXFP4
    trainer computed with other values), with the ``weights`` site on (a trainer without it computed with BF16
    weights). Stock ModelOpt loaders ignore the checkpoint's ``trace`` entry and would serve those NVFP4 weights."""
    if trace_config is None:
        return
    if trace_config.format != "nvfp4":
        raise ValueError(f"TraceConfig.format={trace_config.format!r}: the ModelOpt export stores NVFP4 expert weights "
                         "(valid: 'nvfp4'); an engine would serve other weights than this trainer fake-quantizes")
    if not trace_config.quantizes("weights"):
        raise ValueError(f"TraceConfig(enabled={trace_config.enabled}, sites={trace_config.sites}) does not quantize "
                         "'weights': the trainer computes with BF16 expert weights, the ModelOpt export stores them in "
                         "NVFP4 (quantize 'weights', or serve the BF16 checkpoint)")


def _modelopt_tensors(named: Iterable[tuple[str, torch.Tensor | FP4Tensor]], input_amax: Mapping[str, float] | float,
                      trace_extras: bool, dtype: torch.dtype, trace_config: TraceConfig | None,
                      exclude: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``build_modelopt_state``'s tensors one input weight at a time; ``exclude`` gets ``exclude_modules`` at the end.
    An expert's gate half is held until its up half comes (``fp4_stream`` sends them one after the other)."""
    bf16_2d: list[str] = []
    bf16_experts: set[int] = set()
    fc1_halves: dict[tuple[int, int], dict[str, FP4Tensor]] = {}
    moe_layers: set[int] = set()
    layers: set[int] = set()
    used: set[str] = set()
    for name, value in named:
        parsed = parse_expert_name(name)
        if (m := _LAYER.match(name)) is not None:
            layers.add(int(m.group(1)))
        if parsed is not None:
            moe_layers.add(parsed[0])
        bf16_expert = parsed is not None and trace_config is not None and module_excluded(
            trace_config, experts_name(parsed[0]))
        if parsed is None or bf16_expert:
            if isinstance(value, FP4Tensor):
                what = f"TraceConfig.exclude_modules keeps layer {parsed[0]}'s experts in BF16" if bf16_expert \
                    else "only routed-expert weights are exported as NVFP4"
                raise ValueError(f"{name!r}: {what} (got an FP4Tensor)")
            t = value.detach()
            t = t.to(dtype) if t.is_floating_point() else t
            if nonfinite_names([(name, t, None)]):  # (as stored: a float32 value past bf16's range is Inf there)
                raise NonFiniteError(f"{name!r} holds NaN/Inf as stored ({t.dtype}): an engine would load it as is; "
                                     "export finite weights (the routed experts' FP4 values are checked likewise)")
            yield name, t
            if bf16_expert:
                bf16_experts.add(parsed[0])
            elif t.dim() == 2:
                bf16_2d.append(name)
            continue
        if not isinstance(value, FP4Tensor):
            raise TypeError(f"{name!r}: routed-expert weights must be FP4Tensor (quantize with "
                            f"TraceConfig.weight_quantizer(); BF16 experts only for layers "
                            f"TraceConfig.exclude_modules keeps), got {type(value).__name__}")
        prefix = _expert_prefix(name)
        if parsed[2] != "down_proj":
            halves = fc1_halves.setdefault(parsed[:2], {})
            halves[parsed[2]] = value
            if len(halves) == 2:
                _check_fc1_pair(*parsed[:2], fc1_halves.pop(parsed[:2]))
        if isinstance(input_amax, Mapping):
            if prefix not in input_amax:
                raise KeyError(f"no input_amax for {prefix!r}: give the static activation amax of every expert "
                               f"Linear (or one float for all)")
            a = input_amax[prefix]
            used.add(prefix)
        else:
            a = input_amax
        yield from modelopt_linear_tensors(prefix, value, a, trace_extras=trace_extras).items()
    for (layer, expert), h in sorted(fc1_halves.items()):
        _check_fc1_pair(layer, expert, h)
    unused = sorted(set(input_amax) - used) if isinstance(input_amax, Mapping) else []
    if unused:  # (a misspelt name, or an expert kept in BF16: its calibrated amax would be dropped without a word)
        raise ValueError(f"input_amax has {len(unused)} entries for no exported FP4 expert Linear, e.g. "
                         f"{unused[:3]}: keys are the Linears' prefixes ('model.layers.L.mlp.experts.E.down_proj'); "
                         "experts that exclude_modules keeps in BF16 take none")
    if trace_config is not None:  # (a pattern matching none of the model's modules: refused as trainer and engine do)
        excluded_modules(trace_config, moe_layers=moe_layers, attention_layers=layers)
    exclude[:] = sorted([*exclude_modules_of(bf16_2d), *(experts_name(i) for i in bf16_experts)])


def _check_fc1_pair(layer: int, expert: int, h: dict[str, FP4Tensor]) -> None:
    """An engine fuses each expert's gate and up into one w13 with one ``weight_scale_2``: both halves must be there,
    quantized as one matrix (one global amax)."""
    if h.keys() != {"gate_proj", "up_proj"}:
        raise ValueError(f"layer {layer} expert {expert}: only {sorted(h)} given; an FP4 export needs both "
                         "gate_proj and up_proj")
    try:
        join_fc1(h["gate_proj"], h["up_proj"])
    except ValueError as e:
        raise ValueError(f"layer {layer} expert {expert}: {e}") from e


def quant_config_dict(exclude_modules: list[str], *, kv_cache_quant_algo: str | None = None,
                      trace_config: dict | None = None) -> dict:
    """The ``hf_quant_config.json`` content (ModelOpt's nested format)."""
    mods = None if isinstance(exclude_modules, str | bytes) else list(exclude_modules)
    if mods is None or not all(isinstance(m, str) for m in mods):  # (one string was written as its characters)
        raise ValueError(f"exclude_modules={exclude_modules!r} must be a list of module-name patterns (strings)")
    q = {"quant_algo": "NVFP4", "kv_cache_quant_algo": kv_cache_quant_algo, "group_size": NVFP4_BLOCK,
         "exclude_modules": mods}
    d = {"producer": dict(PRODUCER), "quantization": q}
    if trace_config is not None:
        d["trace"] = dict(trace_config)  # read by the TRACE SGLang method; ignored by ModelOpt loaders
    return d


def save_modelopt_checkpoint(
    out_dir: str | os.PathLike,
    named: Iterable[tuple[str, torch.Tensor | FP4Tensor]],
    hf_config: dict,
    input_amax: Mapping[str, float] | float,
    *,
    trace_extras: bool = False,
    trace_config: TraceConfig | dict | None = None,
    max_shard_bytes: int = 4 << 30,
) -> dict:
    """Write ``config.json``, ``hf_quant_config.json`` and safetensors shard(s); returns the quant config.

    The unquantized tensors are stored in bfloat16 and config.json's ``dtype`` says so, whatever ``hf_config`` gave
    (engines serve a ``dtype="auto"`` model in the config's dtype, a float32 one in float16).

    ``named`` is streamed: each weight's checkpoint tensors go to the shard being filled as it comes, so with a
    generator (``fp4_stream`` of the bridge's export) host memory holds about one shard of ``max_shard_bytes``, not
    the model. The directory is replaced as a whole (``StagedCheckpointDir``): written into a temporary sibling and
    renamed into place once complete and fsynced, so an export that fails midway (a refused weight, an I/O error)
    leaves ``out_dir``'s earlier checkpoint as it was; its files that are not checkpoint files are kept.

    ``trace_config`` (a ``TraceConfig`` or its dict) is written into ``hf_quant_config.json`` for the TRACE SGLang
    method; its ``exclude_modules`` experts must come as BF16 tensors (``fp4_stream(..., bf16_layers=...)``), and each
    of its patterns must match a module of the model (``manifest.excluded_modules``, as the trainer and engine check).
    Weights holding NaN/Inf (as stored) are refused by name."""
    hf_config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)  # (a transformers config)
    if "quantization_config" in hf_config:
        raise ValueError("hf_config already has a quantization_config: pass the BF16 model's config.json dict")
    dtype = str(BF16_DTYPE).removeprefix("torch.")  # what the unquantized tensors are stored in: engines run "auto"
    hf_config["dtype"] = dtype  # in the config's dtype (SGLang and vLLM serve a float32 config in float16)
    if "torch_dtype" in hf_config:  # (transformers < 4.56's name)
        hf_config["torch_dtype"] = dtype
    config_text = json.dumps(hf_config, indent=2, sort_keys=True)  # (checked before anything is written)
    if isinstance(trace_config, TraceConfig):
        cfg, trace_config = trace_config, trace_config.to_dict()
    elif trace_config is None or isinstance(trace_config, Mapping):
        cfg = TraceConfig.from_dict(trace_config) if trace_config is not None else None
    else:
        raise TypeError(f"trace_config must be a TraceConfig, its dict or None, got {type(trace_config).__name__}")
    _check_exported_config(cfg)
    exclude: list[str] = []
    tensors = _modelopt_tensors(named, input_amax, trace_extras, BF16_DTYPE, cfg, exclude)
    with StagedCheckpointDir(out_dir) as staged:
        # (metadata "format" only: safetensors writes its keys in a random order, so a second key would make the
        # shards' bytes differ from one export of the same weights to the next)
        with ShardedSafetensorsWriter(staged.path, max_shard_bytes) as writer:
            for name, t in tensors:
                writer.add(name, t)
        qcfg = quant_config_dict(exclude, trace_config=trace_config)
        for fname, text in {"config.json": config_text, QUANT_CONFIG_FILE: json.dumps(qcfg, indent=2)}.items():
            (staged.path / fname).write_text(text)
    logger.info("exported ModelOpt NVFP4 checkpoint to %s: %d tensors in %d shard(s), %d BF16 modules excluded; at "
                "most %.1f MB held at once", out_dir, writer.tensors, len(writer.files), len(exclude),
                writer.peak_bytes / 1e6)
    return qcfg


def load_modelopt_state(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint written by ``save_modelopt_checkpoint`` (single or sharded)."""
    from safetensors.torch import load_file

    index = os.path.join(ckpt_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = [WEIGHTS_FILE]
    state = {}
    for fname in files:
        state.update(load_file(os.path.join(ckpt_dir, fname)))
    return state


def fc1_from_modelopt(state: Mapping[str, torch.Tensor], layer: int, expert: int) -> FP4Tensor:
    """An expert's fc1 [2F, H] (= [gate; up]) read back from the checkpoint."""
    from ..rollout.hf_weights import join_fc1

    p = f"model.layers.{layer}.mlp.experts.{expert}"
    return join_fc1(fp4_from_modelopt(state, f"{p}.gate_proj"), fp4_from_modelopt(state, f"{p}.up_proj"))


__all__ = [
    "build_modelopt_state", "exclude_modules_of", "fc1_from_modelopt", "fp4_from_modelopt", "load_modelopt_state",
    "modelopt_linear_tensors", "quant_config_dict", "save_modelopt_checkpoint",
]
