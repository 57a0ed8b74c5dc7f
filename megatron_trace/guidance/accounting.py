"""Byte accounting of guidance records: exactly what ``SiteRecord`` stores, computed analytically.

One row of ``k`` elements, ``kp = ceil(k / block) * block`` (K padded to the block size):

  payload   kp / 8 bytes (compact: 1 mantissa bit per element) or kp / 2 (full: 4-bit codes)
  scales    kp / block bytes (one E4M3 / E8M0 byte per block)
  amax      4 bytes (NVFP4: an fp32 global amax per row; 0 for MXFP4, and 0 per row for a hand-built record
            with one per-tensor amax: every recorder stores a per-tensor amax on each row, see ``config_fmt_kw``)

Per element NVFP4 is 1 + 8/16 = 1.5 bits (compact) vs 4 + 8/16 = 4.5 bits (full): ratio 1/3,
plus the per-row amax. Only the guidance itself is counted: the ``valid`` mask and the FC2
``expert_ids`` (routing replay data the trainer already has) are side data, see ``side_bytes``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from ..config import ACTIVATION_SITES, KV_SITES, TraceConfig
from ..formats import get_format
from .model_dims import ModelDims
from .site import SiteKey

AMAX_MODES = ("per_row", "per_tensor")


def row_bytes(k: int, *, fmt: str = "nvfp4", compact: bool = True, amax: str = "per_row") -> int:
    """Bytes one guidance row of ``k`` elements occupies."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:  # (2.5 gave 7.0 bytes, NaN nan)
        raise ValueError(f"row length k={k!r} must be an int >= 1")
    if not isinstance(compact, bool):  # ("no" is truthy: compact)
        raise ValueError(f"compact={compact!r} must be a bool")
    if amax not in AMAX_MODES:
        raise ValueError(f"amax={amax!r} is not one of {AMAX_MODES}")
    block = get_format(fmt).block_size
    kp = -(-k // block) * block
    payload = kp // 8 if compact else kp // 2
    amax_bytes = 4 if fmt == "nvfp4" and amax == "per_row" else 0
    return payload + kp // block + amax_bytes


def site_bytes_per_token(dims: ModelDims, layer: int, site: str, *, kv_fmt: str | None = None, **fmt_kw) -> int:
    """Guidance bytes per token of one (layer, site); 0 where the layer has no such site. ``kv_fmt``: the
    K/V records' format when it is not ``fmt`` (``TraceConfig.kv_format``)."""
    if not dims.has_site(layer, site):
        return 0
    rows, k = dims.site_rows(site)
    if kv_fmt and site in KV_SITES:
        fmt_kw = {**fmt_kw, "fmt": kv_fmt}
    return rows * row_bytes(k, **fmt_kw)


def _sites(sites: Iterable[str]) -> tuple[str, ...]:
    """``sites`` as a tuple of activation sites, each named once (``TraceConfig.guided_sites``' rule): a site given
    twice was counted twice per layer by ``bytes_per_layer`` and ``elements_per_layer`` (and once by ``breakdown``)."""
    if isinstance(sites, str):  # (its characters were taken as site names)
        raise ValueError(f"sites={sites!r} must be a list of sites from {ACTIVATION_SITES}, not one string")
    sites = tuple(sites)
    bad = [s for s in sites if s not in ACTIVATION_SITES]
    if bad:
        raise ValueError(f"sites {bad} are not among {ACTIVATION_SITES}")
    twice = sorted({s for s in sites if sites.count(s) > 1}, key=sites.index)
    if twice:
        raise ValueError(f"sites={list(sites)} holds {twice} more than once: name each once")
    return sites


def breakdown(dims: ModelDims, sites: Iterable[str], layers: Iterable[int], **fmt_kw) -> dict[SiteKey, int]:
    """Bytes per token for every (layer, site) that exists. ``fmt_kw``: fmt, compact, amax."""
    sites, out = _sites(sites), {}
    for layer in layers:
        dims.check_layer(layer)
        for site in sites:
            n = site_bytes_per_token(dims, layer, site, **fmt_kw)
            if n:
                out[(layer, site)] = n
    return out


def bytes_per_token(dims: ModelDims, sites: Iterable[str], layers: Iterable[int], **fmt_kw) -> int:
    """Total guidance bytes per token over the selected sites and layers."""
    return sum(breakdown(dims, sites, layers, **fmt_kw).values())


def totals(per_key: dict[SiteKey, int], tokens: int = 1) -> dict[str, dict]:
    """Sums of a ``breakdown`` by site and by layer, times ``tokens`` (an int >= 0)."""
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ValueError(f"tokens={tokens!r} must be an int >= 0 (a token count)")  # (2.5 gave 75.0 bytes, -3 < 0)
    by_site: dict[str, int] = {}
    by_layer: dict[int, int] = {}
    for (layer, site), n in per_key.items():
        by_site[site] = by_site.get(site, 0) + n * tokens
        by_layer[layer] = by_layer.get(layer, 0) + n * tokens
    return {"by_site": by_site, "by_layer": by_layer, "total": sum(by_site.values())}


def bytes_per_layer(dims: ModelDims, sites: Iterable[str], **fmt_kw) -> dict[int, int]:
    """Bytes per token each layer would cost if guided (input of the budget policy)."""
    sites = _sites(sites)
    return {i: sum(site_bytes_per_token(dims, i, s, **fmt_kw) for s in sites) for i in range(dims.num_layers)}


def elements_per_layer(dims: ModelDims, sites: Iterable[str]) -> dict[int, int]:
    """Elements per token each layer would guide (rows x row length summed over its ``sites``): what a per-layer
    code-mismatch rate is a fraction of (the budget policy's weight)."""
    sites = _sites(sites)
    out = {}
    for i in range(dims.num_layers):
        shapes = [dims.site_rows(s) for s in sites if dims.has_site(i, s)]
        out[i] = sum(rows * k for rows, k in shapes)
    return out


def config_fmt_kw(config: TraceConfig) -> dict:
    """The ``fmt``/``kv_fmt``/``compact``/``amax`` keywords that a TraceConfig implies. ``amax`` is always
    ``per_row``: with ``activation_amax="per_tensor"`` each prefill or decode step has its own tensor amax, and
    the recorders (rollout, SGLang capture, trainer) store it on every row of the step."""
    return dict(fmt=config.format, kv_fmt=config.kv_record_format, compact=config.cache_mode == "compact",
                amax="per_row")


def side_bytes(dims: ModelDims, layer: int, site: str, *, expert_id_bytes: int = 8) -> int:
    """Per-token side data of a site record: ``valid`` (1 byte/row) and FC2 expert ids."""
    if site not in ACTIVATION_SITES:
        raise ValueError(f"site={site!r} is not one of {ACTIVATION_SITES}")
    if isinstance(expert_id_bytes, bool) or not isinstance(expert_id_bytes, numbers.Integral) or expert_id_bytes < 1:
        raise ValueError(f"expert_id_bytes={expert_id_bytes!r} must be an int >= 1")  # (2.5 gave 7.0 bytes, True 1)
    if not dims.has_site(layer, site):
        return 0
    rows, _ = dims.site_rows(site)
    valid = rows if site == "expert_fc2_in" else 1  # valid is [S] for FC1/KV, [S, topk] for FC2
    return valid + (rows * expert_id_bytes if site == "expert_fc2_in" else 0)
