"""Planning guidance sizes: the budget layer policy and the per-policy size table behind ``plan``.

``budget_layers`` picks the layers that remove the most code mismatch per byte, each taken if it still fits under
``config.budget_bytes_per_token`` (the budget is never exceeded). The mismatch profile is, by default, a per-layer
*rate*: the fraction of that layer's guided elements whose FP4 code differs between trainer and rollout (README,
"Reading the metrics": ``quant/<site>/layer_<L>/code_mismatch_rate`` of an unguided FP4 arm, element-weighted over
the guided sites; ``mismatch_profile.profile_from_metrics`` reads it from a run's metrics.jsonl). Guiding a layer
removes rate x its guided elements, and elements are about proportional to guidance bytes, so the value per byte is
about the rate: layers are taken by rate x elements / bytes (``plan_row`` knows the elements; without them, by
rate), deeper first on ties. ``profile_unit="mass"`` takes per-layer *masses* instead (mismatched codes guiding the
layer removes, any common scale), ranked by mass / bytes. A layer with zero measured mismatch is not taken (guiding
it removes nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import KV_SITES, TraceConfig
from ..formats import get_format
from .accounting import bytes_per_layer, bytes_per_token, config_fmt_kw, elements_per_layer, side_bytes
from .model_dims import ModelDims
from .routing import id_dtype
from .selection import check_num_layers, guided_layers
from .site import is_integer
from .sync import PROTOCOL, SIZES

logger = logging.getLogger(__name__)


def _number(v, what: str, where, cast):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # (None, a string, a list: a TypeError unnamed)
        raise ValueError(f"{what} holds {v!r} {where}: each value must be a number")
    if cast is int and not (math.isfinite(v) and v == int(v)):  # (int() truncated 5.9 bytes to 5: over budget)
        raise ValueError(f"{what} holds {v!r} {where}: each value must be a whole number (a count)")
    return cast(v)


def _per_layer(value, num_layers: int, what: str, cast) -> list:
    if value is None:
        raise ValueError(
            f"the budget layer policy needs {what} for each of the {num_layers} layers "
            "(per-layer quant/<site>/layer_<L>/code_mismatch_rate of an unguided FP4 run, README: Reading the metrics; "
            "mismatch_profile.profile_from_metrics reads them from its metrics.jsonl)"
        )
    if isinstance(value, Mapping):
        missing = sorted(set(range(num_layers)) - set(value))
        extra = sorted(set(value) - set(range(num_layers)))
        if missing or extra:
            raise ValueError(f"{what} must have keys 0..{num_layers - 1}: missing {missing}, unknown {extra}")
        vals = [_number(value[i], what, f"at layer {i}", cast) for i in range(num_layers)]
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        vals = [_number(value, what, "(for every layer)", cast)] * num_layers
    elif isinstance(value, str | bytes | bool):
        raise ValueError(f"{what}={value!r} must be a number, a list of {num_layers} numbers or {{layer: number}}")
    else:
        vals = [_number(v, what, f"at layer {i}", cast) for i, v in enumerate(value)]
        if len(vals) != num_layers:
            raise ValueError(f"{what} has {len(vals)} entries, expected num_layers={num_layers}")
    bad = [(i, v) for i, v in enumerate(vals) if not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"{what} must be finite and >= 0; bad (layer, value): {bad[:5]}")
    return vals


PROFILE_UNITS = ("rate", "mass")


def budget_layers(
    config: TraceConfig,
    num_layers: int,
    *,
    mismatch_profile: Mapping[int, float] | Sequence[float] | None = None,
    bytes_per_layer: Mapping[int, int] | int | None = None,
    elements_per_layer: Mapping[int, int] | int | None = None,
    profile_unit: str = "rate",
) -> tuple[int, ...]:
    """Sorted layer ids maximising removed code mismatch per byte within ``config.budget_bytes_per_token``.

    ``mismatch_profile``: per layer (a list, ``{layer: value}`` or one number for all), in ``profile_unit``:
    ``"rate"`` (default), the fraction in [0, 1] of the layer's guided elements whose code differs (the module
    docstring), or ``"mass"``, the mismatch guiding the layer removes. ``bytes_per_layer``: guidance bytes per
    token of each layer (``accounting.bytes_per_layer``) or one int for all layers. ``elements_per_layer``: guided
    elements per token of each layer (``accounting.elements_per_layer``; ``plan_row`` passes it; rates only): a rate
    is then weighted by the layer's elements per byte exactly (a 128-element KV row carries a 4-byte amax, a
    7168-element FC1 row the same 4 bytes: 16% apart in compact mode); without it elements are taken as
    proportional to bytes and layers rank by rate.
    """
    check_num_layers(num_layers)  # (0 or -1 chose no layer, silently)
    budget = float(config.budget_bytes_per_token)
    if budget <= 0:
        raise ValueError(f"budget_bytes_per_token={budget} must be > 0 for the budget policy")
    if profile_unit not in PROFILE_UNITS:
        raise ValueError(f"profile_unit={profile_unit!r} is not one of {PROFILE_UNITS}")
    profile = _per_layer(mismatch_profile, num_layers, "mismatch_profile", float)
    if profile_unit == "rate":
        over = [(i, v) for i, v in enumerate(profile) if v > 1]
        if over:
            raise ValueError(f"mismatch_profile rates must be fractions in [0, 1]; (layer, value) above 1: {over[:5]} "
                             "(per-layer mismatch masses: profile_unit='mass', --mismatch-unit mass)")
    if bytes_per_layer is None:
        raise ValueError("the budget layer policy needs bytes_per_layer (see accounting.bytes_per_layer)")
    cost = _per_layer(bytes_per_layer, num_layers, "bytes_per_layer", int)
    if profile_unit == "mass":
        density = [p / c if c else math.inf if p else 0.0 for p, c in zip(profile, cost)]  # free and useful: first
    elif elements_per_layer is None:
        density = [p if c else 0.0 for p, c in zip(profile, cost)]  # no bytes: no guided elements, nothing removed
    else:
        elems = _per_layer(elements_per_layer, num_layers, "elements_per_layer", int)
        density = [p * e / c if c else 0.0 for p, e, c in zip(profile, elems, cost)]
    useful = [p > 0 and (c > 0 or profile_unit == "mass") for p, c in zip(profile, cost)]  # (not density > 0:
    order = sorted((i for i in range(num_layers) if useful[i]), key=lambda i: (-density[i], -i))  # it underflows)
    chosen, used = [], 0
    for i in order:
        if used + cost[i] <= budget:
            chosen.append(i)
            used += cost[i]
    logger.info("budget policy (%s profile): %d layers, %d of %.0f bytes/token", profile_unit, len(chosen), used,
                budget)
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class RLSettings:
    """One RL step as the planner sees it."""

    trajectories: int = 4096
    prompt_len: int = 1024
    response_len: int = 8192
    bandwidth_gbps: float = 400.0  # gigabits per second of the rollout -> trainer link
    steps_in_flight: int = 1  # rollout steps held on the host at once (async RL: staleness + 1)

    def __post_init__(self):
        for f, low in (("trajectories", 1), ("prompt_len", 0), ("response_len", 1), ("steps_in_flight", 1)):
            v = getattr(self, f)  # a NaN or 2.5 passes every comparison: check the type first
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
                raise ValueError(f"{f}={v!r} must be an int >= {low}")
        b = self.bandwidth_gbps
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not (math.isfinite(b) and b > 0):
            raise ValueError(f"bandwidth_gbps={b!r} must be a finite number > 0 (gigabits per second)")

    @property
    def tokens_per_step(self) -> int:
        return self.trajectories * (self.prompt_len + self.response_len)


def plan_row(dims: ModelDims, config: TraceConfig, rl: RLSettings, policy: str, **budget_kw) -> dict:
    """Sizes of one (layer policy, cache mode) choice for one RL step of ``rl.trajectories`` samples.

    ``bytes_per_token`` / ``bytes_per_step``: the guidance proper (payload + scales + amax: the paper's figures).

    ``host_bytes``: what ``GuidanceCache`` holds for ``rl.steps_in_flight`` steps (``GuidanceCache.host_bytes``),
    exactly: a rollout batch put whole (``records.pack_guidance`` or a whole ``split_batch``, as the RL driver puts
    it) is kept as columns, the guidance plus every row's ``valid`` flag and the FC2 rows' int64 expert ids. (Samples
    put one by one are kept in the flat form, each tensor 16-byte aligned: ``shard_bytes``' ``flat``, at most 15
    bytes more per tensor and sample.) Routing is not in the cache.

    ``sync_bytes`` / ``sync_seconds``: one ``GuidanceSync`` transfer of the whole step to one trainer rank in one
    chunk, over one link of ``rl.bandwidth_gbps`` with no overlap, an upper bound: the payload (guidance, valid
    flags, FC2 expert ids and, with ``config.routing_replay``, every MoE layer's routing; each field 16-byte aligned,
    the last one's padding, < 16 bytes, counted too), the size message (48 bytes) and the JSON header, which varies
    per message and is bounded (``sync_header_bound``). Each further chunk or trainer rank adds a size message and
    a header; ``rank_projection`` gives each rank's payload.
    """
    rec = _recorded(dims, config)  # (the modules exclude_modules keeps in BF16 record nothing)
    if config.guided_layers == "budget":
        fmt_kw = config_fmt_kw(config)
        budget_kw.setdefault("bytes_per_layer", bytes_per_layer(rec, config.guided_sites, **fmt_kw))
        budget_kw.setdefault("elements_per_layer", elements_per_layer(rec, config.guided_sites))
    layers = _guided(dims, config, None, **budget_kw)
    bpt = bytes_per_token(rec, config.guided_sites, layers, **config_fmt_kw(config))
    side = sum(side_bytes(rec, layer, site) for layer in layers for site in config.guided_sites)
    lengths = [rl.prompt_len + rl.response_len] * rl.trajectories
    payload = _align(shard_bytes(dims, config, lengths, layers=layers)["sync_payload"])
    sync = payload + SIZE_MESSAGE_BYTES + sync_header_bound(dims, config, lengths, layers=layers, payload=payload)
    return {
        "policy": policy,
        "mode": config.cache_mode,
        "format": config.format,
        "kv_format": config.kv_format,
        "num_layers": len(layers),
        "layers": list(layers),
        "bytes_per_token": bpt,
        "bytes_per_step": bpt * rl.tokens_per_step,
        "host_bytes": (bpt + side) * rl.tokens_per_step * rl.steps_in_flight,
        "sync_bytes": sync,
        "sync_seconds": sync * 8 / (rl.bandwidth_gbps * 1e9),
    }


def _recorded(dims: ModelDims, config: TraceConfig) -> ModelDims:
    """``dims`` whose MoE / KV-cache layers are those with a module ``config.exclude_modules`` keeps in FP4: the sites
    that are recorded (an excluded module's were sized as guided). Routing is sized from ``dims``: every MoE layer's
    router runs and is replayed, its experts quantized or not."""
    from ..manifest import experts_name, kv_cache_name, module_excluded  # (manifest imports guidance.selection)

    return dataclasses.replace(
        dims, moe_layers=tuple(i for i in dims.moe_layers if not module_excluded(config, experts_name(i))),
        kv_layers=tuple(i for i in dims.kv_layers if not module_excluded(config, kv_cache_name(i))))


def _guided(dims: ModelDims, config: TraceConfig, layers, **budget_kw) -> tuple[int, ...]:
    """``layers`` (None: ``config``'s layer policy over ``dims``), refused by name where they would guide nothing
    (``manifest.check_guided_layers`` on ``dims``' MoE and KV-cache layers): an explicit layer without a KV cache
    under KV sites only, or without routed experts under expert sites only, was planned at 0 bytes, silently. An
    ``exclude_modules`` pattern that names none of the model's modules (the K/V cache of a linear-attention layer, a
    dense layer's experts) is refused too (``manifest.excluded_modules``)."""
    from ..manifest import check_guided_layers, excluded_modules  # (manifest imports guidance.selection)

    excluded_modules(config, moe_layers=dims.moe_layers, attention_layers=dims.kv_layers)
    layers = tuple(guided_layers(config, dims.num_layers, **budget_kw) if layers is None else layers)
    for layer in layers:  # (a layer off the model or 1.5 is named as such first)
        dims.check_layer(layer)
    check_guided_layers(config, layers, moe_layers=dims.moe_layers, kv_layers=dims.kv_layers)
    return layers


# ---- per-rank shard sizes: what the guidance code stores and sends, byte for byte -------------------
ALIGN = 16  # serial.ALIGN / routing.ALIGN: every tensor of the flat form starts 16-byte aligned
SIZE_MESSAGE_BYTES = 8 * SIZES  # GuidanceSync's int64 size message before each chunk's header
_ITEMSIZE = {"uint8": 1, "bool": 1, "int16": 2, "int32": 4, "int64": 8, "float32": 4}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _token_counts(sample_tokens) -> list[int]:
    """Each sample's token count, an int >= 0 (2.5 was truncated to 2, "3" parsed, True taken as 1)."""
    if isinstance(sample_tokens, str | bytes):
        raise ValueError(f"sample_tokens={sample_tokens!r} must be a list of token counts (ints >= 0)")
    counts = list(sample_tokens)
    bad = [n for n in counts if not (is_integer(n) and n >= 0)]
    if bad:
        raise ValueError(f"sample_tokens holds {bad[:5]}: each must be a token count, an int >= 0")
    return [int(n) for n in counts]


def _site_fields(dims: ModelDims, site: str, tokens: int, config: TraceConfig) -> tuple[dict, list[tuple]]:
    """(column meta, [(field, dtype name, shape)]) of one (layer, site) record of ``tokens`` token rows, in the
    order ``serial._site_tensors`` and ``packed.pack_batch`` lay the fields out."""
    rows, k = dims.site_rows(site)
    fmt = config.kv_record_format if site in KV_SITES else config.format
    block = get_format(fmt).block_size
    kp = -(-k // block) * block
    lead, fc2 = [tokens] if site == "expert_fc1_in" else [tokens, rows], site == "expert_fc2_in"
    fields = [("payload", "uint8", [*lead, kp // 8 if config.cache_mode == "compact" else kp // 2]),
              ("scales", "uint8", [*lead, kp // block]),
              ("valid", "bool", [tokens, rows] if fc2 else [tokens])]  # bool [L] or [L, topk]
    if fmt == "nvfp4":  # fp32 per row (a per-tensor amax too: the recorders store it on each row)
        fields.append(("amax", "float32", [*lead, 1]))
    if fc2:
        fields.append(("expert_ids", "int64", [tokens, rows]))
    meta = {"mode": config.cache_mode, "fmt": fmt, "shape": lead[1:] + [k], "amax": "row" if fmt == "nvfp4" else None}
    return meta, fields


def _site_tensor_bytes(dims: ModelDims, site: str, tokens: int, config: TraceConfig) -> dict[str, int]:
    """Bytes of each tensor one sample's record of ``site`` holds (the fields of ``serial._site_tensors``)."""
    return {name: math.prod(shape) * _ITEMSIZE[dt] for name, dt, shape in _site_fields(dims, site, tokens, config)[1]}


def _routing_dtype(dims: ModelDims) -> str:
    """The name of the dtype ``routing.id_dtype`` stores the model's expert ids in."""
    return str(id_dtype(dims.num_experts)).removeprefix("torch.")


def sample_bytes(dims: ModelDims, config: TraceConfig, num_tokens: int, *, layers=None) -> dict[str, int]:
    """Bytes of one sample of ``num_tokens`` tokens as the guidance code holds and sends it.

    ``guidance``: payload + scales + amax (``SampleGuidance.guidance_nbytes``; per-token part =
    ``accounting.bytes_per_token``); ``flat``: its serial form with ``valid``, FC2 ``expert_ids`` and
    16-byte alignment (host cache bytes, ``serial.plan_flat``); ``routing``: the expert ids of every MoE layer
    in the smallest integer type (``routing.plan_routing``). ``layers``: guided layers (default: the config's).
    """
    if not is_integer(num_tokens) or num_tokens < 0:  # (2.5 gave float bytes, True one token)
        raise ValueError(f"num_tokens={num_tokens!r} must be an int >= 0")
    if dims.num_experts < 1:
        raise ValueError("ModelDims.num_experts must be >= 1 to size the routing (read it from the HF config)")
    layers, rec = _guided(dims, config, layers), _recorded(dims, config)
    guidance = flat = 0
    for layer in layers:
        for site in config.guided_sites:
            if not rec.has_site(layer, site):
                continue
            parts = _site_tensor_bytes(dims, site, num_tokens, config)
            guidance += parts["payload"] + parts["scales"] + parts.get("amax", 0)
            flat += sum(_align(p) for p in parts.values())
    id_bytes = _ITEMSIZE[_routing_dtype(dims)]
    routing = len(dims.moe_layers) * _align(num_tokens * dims.topk * id_bytes) if config.routing_replay else 0
    return {"guidance": guidance, "flat": flat, "routing": routing}


def _wire_fields(dims: ModelDims, config: TraceConfig, sample_tokens: list[int], layers) -> list[int]:
    """Bytes of every payload field of a one-chunk ``GuidanceSync`` send (``guidance.wire``, protocol 6), in
    payload order: per guided (layer, site) column its fields over all the samples' rows, then per MoE layer the
    routing column."""
    tokens, fields, rec = sum(sample_tokens), [], _recorded(dims, config)
    for layer in sorted(layers):
        for site in sorted(config.guided_sites):
            if rec.has_site(layer, site):
                fields += list(_site_tensor_bytes(dims, site, tokens, config).values())
    if config.routing_replay:
        fields += [tokens * dims.topk * _ITEMSIZE[_routing_dtype(dims)]] * len(dims.moe_layers)
    return fields


def shard_bytes(dims: ModelDims, config: TraceConfig, sample_tokens, *, layers=None) -> dict[str, int]:
    """Sums of ``sample_bytes`` over one trainer rank's samples (their token counts), plus ``sync_payload``: the
    payload bytes ``GuidanceSync`` sends that rank in one chunk (``TransferStats.payload_bytes``: every column
    field 16-byte aligned, the last one unpadded). The planner lays the columns out in (layer, site) order, the
    wire in the records' order: with routing replay the last field is the last routing column either way, without it
    the last guidance field's padding (< 16 bytes) may differ."""
    sample_tokens = _token_counts(sample_tokens)
    layers = _guided(dims, config, layers)
    tot = {"guidance": 0, "flat": 0, "routing": 0}
    for n, times in Counter(sample_tokens).items():
        for key, v in sample_bytes(dims, config, n, layers=layers).items():
            tot[key] += v * times
    tot["samples"] = len(sample_tokens)
    off = end = 0
    for f in _wire_fields(dims, config, sample_tokens, layers) if sample_tokens else ():
        end = off + f
        off = _align(end)
    tot["sync_payload"] = end
    return tot


def sync_header_bound(dims: ModelDims, config: TraceConfig, sample_tokens, *, layers=None,
                      payload: int | None = None) -> int:
    """An upper bound of the JSON header of a one-chunk ``GuidanceSync`` send of samples of ``sample_tokens`` tokens
    (each with its guidance and, with ``config.routing_replay``, its routing), built as ``guidance.wire`` writes it
    with the widest values it can hold: sample ids and versions of 20 characters (any int64), every field offset as
    wide as ``payload`` (the payload bytes; default ``shard_bytes``' ``sync_payload``) and a CRC-32 on every field
    (``verify=True``). Token hashes, token counts, keys, metas and shapes are exact; the rest varies per message."""
    sample_tokens = _token_counts(sample_tokens)
    layers, rec = _guided(dims, config, layers), _recorded(dims, config)
    if payload is None:
        payload = shard_bytes(dims, config, sample_tokens, layers=layers)["sync_payload"]
    elif isinstance(payload, bool) or not isinstance(payload, numbers.Integral) or payload < 0:
        # (-1 or 0.5 wrote offsets narrower than any real one: a bound below the header it bounds)
        raise ValueError(f"payload={payload!r} must be an int >= 0 (the send's payload bytes) or None")
    n, tokens, wide = len(sample_tokens), sum(sample_tokens), -(2**63)  # the widest id or version: 20 characters

    def column(key, meta: dict, fields: list[tuple]) -> dict:
        return {"key": key, "meta": meta, "members": None, "rows": None,
                "fields": [[name, dt, shape, payload, "crc32:00000000"] for name, dt, shape in fields]}

    guidance = routing = None
    if n:
        table = {"ids": [wide] * n, "versions": [wide] * n, "hashes": ["0" * 32] * n, "tokens": sample_tokens}
        guidance = {"columns": [column([layer, site], *_site_fields(dims, site, tokens, config))
                                for layer in sorted(layers) for site in sorted(config.guided_sites)
                                if rec.has_site(layer, site)], "table": table}
        if config.routing_replay:  # the same samples: the routing section's table is null
            routing = {"columns": [column(layer, {}, [("experts", _routing_dtype(dims), [tokens, dims.topk])])
                                   for layer in dims.moe_layers], "table": None}
    head = {"protocol": PROTOCOL, "guidance": guidance, "routing": routing}
    return len(json.dumps(head, separators=(",", ":")).encode())


def rank_projection(dims: ModelDims, config: TraceConfig, rl: RLSettings, *, dp_ranks: int,
                    bandwidths_gbytes: Mapping[str, float] | None = None, layers=None) -> dict:
    """Per trainer rank of ``dp_ranks`` data-parallel ranks (each trains ``ceil(trajectories / dp_ranks)`` whole
    samples of ``prompt_len + response_len`` tokens): guidance, host cache (x steps in flight) and sync payload
    bytes per step, and the sync seconds at each given bandwidth (name -> GB/s, e.g. measured points).
    ``layers``: the guided layers (default: the config's policy; pass them for the budget policy)."""
    if isinstance(dp_ranks, bool) or not isinstance(dp_ranks, numbers.Integral) or dp_ranks < 1:
        raise ValueError(f"dp_ranks={dp_ranks!r} must be an int >= 1")  # (2.5 sized ceil(T / 2.5) samples, True 1)
    if dp_ranks > rl.trajectories:
        logger.warning("dp_ranks=%d > trajectories=%d: %d ranks would train no sample each step (the projection is "
                       "the busiest rank's: one sample)", dp_ranks, rl.trajectories, dp_ranks - rl.trajectories)
    samples = -(-rl.trajectories // dp_ranks)
    sb = shard_bytes(dims, config, [rl.prompt_len + rl.response_len] * samples, layers=layers)
    bw = dict(bandwidths_gbytes or {})
    bad = {k: v for k, v in bw.items()
           if isinstance(v, bool) or not (isinstance(v, numbers.Real) and math.isfinite(v) and v > 0)}  # (True: 1)
    if bad:
        raise ValueError(f"bandwidths must be finite GB/s > 0, got {bad}")
    return {
        "dp_ranks": dp_ranks, "samples_per_rank": samples,
        "tokens_per_rank": samples * (rl.prompt_len + rl.response_len),
        "guidance_bytes_per_rank": sb["guidance"], "routing_bytes_per_rank": sb["routing"],
        "cache_host_bytes_per_rank": sb["flat"] * rl.steps_in_flight,
        "sync_payload_bytes_per_rank": sb["sync_payload"],
        "sync_seconds": {k: sb["sync_payload"] / (v * 1e9) for k, v in bw.items()},
    }
