"""Train-rollout mismatch metrics (README: "Reading the metrics"), as flat ``{name: float}`` dicts for TensorBoard/W&B.

Log-prob metrics take the trainer's recomputed ``lt = log pi_train(y_t)`` and the rollout's
``lr = log mu_rollout(y_t)``, both [B, S], and a bool response mask [B, S]; ``d = lt - lr``,
``r = exp(d)``. Quantization metrics compare, per (layer, site), the trainer's and the
rollout's FP4 outcome for the same rows (codes compared by decoded value: +0 == -0; block
scales by their E4M3/E8M0 code, so a per-row global amax that differs in the last bit alone
is not a scale mismatch; ``d_act_rel`` uses the fully decoded values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .formats import CompactGuidance, FP4Tensor, FullGuidance, Quantizer, e2m1, get_format
from .guidance.site import NOT_GUIDED, FallbackCounter, SiteGuidance

IS_CLAMP = 5.0
"""ESS weights are r clamped to [1/5, 5] (the paper's IS cap)."""


def _masked(lt: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor):
    for what, t in (("trainer", lt), ("rollout", lr)):  # (int log-probs were truncated, complex lost their imaginary
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():  # part: both with no error)
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what} log-probs must be a floating-point tensor [B, S], got {got}")
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a bool tensor [B, S], got {type(mask).__name__}")
    if lt.shape != lr.shape or lt.shape != mask.shape:
        raise ValueError(f"trainer {tuple(lt.shape)}, rollout {tuple(lr.shape)} and mask {tuple(mask.shape)} "
                         "log-prob shapes must be equal [B, S]")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if lt.dim() != 2:
        raise ValueError(f"log-probs must be [B, S], got shape {tuple(lt.shape)}")
    if not bool(mask.any()):
        raise ValueError("mask selects no token: mismatch metrics need at least one response token")
    return lt.double(), lr.double(), mask


def token_mult_prob_error(lt: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor) -> float:
    """NeMo-RL's ``token_mult_prob_error``: mean over masked tokens of exp(|lt - lr|) (1 = identical;
    NeMo-RL treats > 1.05 as a framework bug)."""
    lt, lr, mask = _masked(lt, lr, mask)
    return float((lt - lr).abs()[mask].exp().mean())


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / den if den > 0 else float("nan")


def mismatch_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     prefix: str = "mismatch") -> dict[str, float]:
    """Every ``mismatch/*`` metric (README, "Reading the metrics"; ``prob_pearson`` is NaN for < 2 tokens or constant
    probs)."""
    lt, lr, mask = _masked(trainer_logprobs, rollout_logprobs, mask)
    d_all = lt - lr  # [B, S]
    d = d_all[mask]  # [N]
    r = d.exp()
    w = r.clamp(1.0 / IS_CLAMP, IS_CLAMP)
    has = mask.any(1)  # sequences with >= 1 response token
    ntok = mask.sum(1)
    d_in = torch.where(mask, d_all, 0.0)  # positions outside the mask may hold NaN / -inf: select, not multiply
    seq_abs = d_in.abs().sum(1)[has] / ntok[has]
    seq_sum = d_in.sum(1)[has]
    first = mask.long().argmax(1)[has]  # first response position of each sequence
    first_d = d_all[has].gather(1, first.unsqueeze(1)).squeeze(1).abs()
    nan = d.isnan().any()  # a NaN log-prob: a token share is NaN too, like every mean (a comparison counted it as out)

    def share(tokens: torch.Tensor) -> float:
        return float(torch.where(nan, float("nan"), tokens.double().mean()))

    p = f"{prefix}/"
    return {
        p + "logprob_abs_diff": float(seq_abs.mean()),
        p + "logprob_abs_diff_token_mean": float(d.abs().mean()),
        p + "logprob_abs_diff_token_max": float(d.abs().max()),
        p + "kl_k1": float((-d).mean()),
        p + "kl_k3": float((r - d - 1).mean()),
        p + "is_ratio_min": float(r.min()),
        p + "is_ratio_mean": float(r.mean()),
        p + "is_ratio_max": float(r.max()),
        p + "is_frac_outside_0.5_2": share((r > 2) | (r < 0.5)),
        p + "ess": float(1.0 / ((w / w.mean()) ** 2).mean()),
        p + "seq_logratio_abs_mean": float(seq_sum.abs().mean()),
        p + "prob_pearson": _pearson(lt[mask].exp(), lr[mask].exp()),
        p + "token_mult_prob_error": float(d.abs().exp().mean()),
        p + "frac_abs_diff_gt_ln2": share(d.abs() > math.log(2)),
        p + "first_token_abs_diff": float(first_d.mean()),
    }


# ---- quantization ------------------------------------------------------------------------------
@dataclass
class QuantCounts:
    """Additive counts behind the ``quant/*`` rates (sum them over layers for per-site rates)."""

    elements: int = 0
    mismatched: int = 0
    adjacent: int = 0
    blocks: int = 0
    scale_mismatched: int = 0
    diff_sq: float = 0.0
    ref_sq: float = 0.0

    def __add__(self, other: QuantCounts) -> QuantCounts:
        return QuantCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def rates(self) -> dict[str, float]:
        nan = float("nan")
        return {
            "code_mismatch_rate": self.mismatched / self.elements if self.elements else nan,
            "adjacent_share": self.adjacent / self.mismatched if self.mismatched else nan,
            "scale_mismatch_rate": self.scale_mismatched / self.blocks if self.blocks else nan,
            "d_act_rel": math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq > 0 else nan,
        }


def _values(t: FP4Tensor | FullGuidance) -> torch.Tensor:
    """Grid values (unscaled), float32 [..., K]."""
    return e2m1.decode(e2m1.unpack(t.codes))[..., : t.shape[-1]]


def effective_scales(t) -> torch.Tensor:
    """Per-block decode scale, float32 [..., nb]: fp32(sf) / S_enc (NVFP4), 2^e (MXFP4)."""
    s = t.block_scales
    return get_format(t.fmt).unscale(torch.ones(*s.shape, 1, device=s.device), s, t.global_amax)[..., 0]


def quant_counts(trainer: FP4Tensor, rollout: FP4Tensor | FullGuidance | CompactGuidance,
                 rows: torch.Tensor | None = None) -> QuantCounts:
    """Compare two FP4 outcomes of the same rows; ``rows`` (bool over leading dims, e.g. a site's
    ``valid`` [B, S] for KV rows [B, S, heads]) selects rows.

    With a ``CompactGuidance`` rollout record only the scales can be compared (codes unknown).
    """
    if tuple(trainer.shape) != tuple(rollout.shape) or trainer.fmt != rollout.fmt:
        raise ValueError(f"trainer {trainer.fmt} {tuple(trainer.shape)} and rollout {rollout.fmt} "
                         f"{tuple(rollout.shape)} are not the same rows")
    lead = tuple(trainer.shape[:-1])
    if rows is not None and (not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool):  # (.bool() took
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__  # row ids [0, 2] as a mask)
        raise ValueError(f"rows must be a bool mask over the leading dims {lead}, got {got}")
    rows = torch.ones(lead, dtype=torch.bool, device=trainer.codes.device) if rows is None else rows
    if tuple(rows.shape) != lead[: rows.dim()]:
        raise ValueError(f"rows mask shape {tuple(rows.shape)} is not a prefix of the leading dims {lead}")
    rows = rows.reshape(*rows.shape, *([1] * (len(lead) - rows.dim()))).expand(lead)
    bt, br = trainer.block_scales.view(torch.uint8)[rows], rollout.block_scales.view(torch.uint8)[rows]
    c = QuantCounts(blocks=bt.numel(), scale_mismatched=int((bt != br).sum()))
    if isinstance(rollout, CompactGuidance):
        return c
    st, sr = effective_scales(trainer)[rows], effective_scales(rollout)[rows]  # [N, nb]
    vt, vr = _values(trainer)[rows], _values(rollout)[rows]  # [N, K]
    diff = vt != vr
    grid = torch.tensor(e2m1.SIGNED_GRID, device=vt.device)
    it, ir = torch.searchsorted(grid, vt.contiguous()), torch.searchsorted(grid, vr.contiguous())
    k = trainer.shape[-1]
    xt = vt * st.repeat_interleave(trainer.block_size, -1)[..., :k]  # dequantized [N, K]
    xr = vr * sr.repeat_interleave(trainer.block_size, -1)[..., :k]
    c.elements, c.mismatched = vt.numel(), int(diff.sum())
    c.adjacent = int((diff & ((it - ir).abs() == 1)).sum())
    c.diff_sq, c.ref_sq = float(((xt - xr).double() ** 2).sum()), float((xr.double() ** 2).sum())
    return c


def trainer_counts_from_guidance(x_train: torch.Tensor, site: SiteGuidance, quantizer: Quantizer,
                                 *, guided: bool = False) -> QuantCounts:
    """Quantize the trainer's activations ``x_train`` (the site's batch-major layout) with its own RNE
    (or guided by the record, ``guided=True``) and compare with the rollout record on valid rows."""
    q = quantizer.guided_quantize(x_train, site.record) if guided else quantizer.quantize(x_train)
    return quant_counts(q, site.record, rows=site.valid)


def quant_metrics(counts: dict[tuple[int, str], QuantCounts], prefix: str = "quant") -> dict[str, float]:
    """``quant/{site}/{rate}`` (element-weighted over layers) and ``quant/{site}/layer_{L}/{rate}``."""
    out: dict[str, float] = {}
    per_site: dict[str, QuantCounts] = {}
    for (layer, site), c in sorted(counts.items()):
        per_site[site] = per_site.get(site, QuantCounts()) + c
        out.update({f"{prefix}/{site}/layer_{layer}/{k}": v for k, v in c.rates().items()})
    for site, c in per_site.items():
        out.update({f"{prefix}/{site}/{k}": v for k, v in c.rates().items()})
    return out


NOT_GUIDED_REASON = NOT_GUIDED
"""The fallback reason of rows at layers outside the layer policy (``guidance.site.NOT_GUIDED``)."""


def guidance_coverage(counter: FallbackCounter) -> float:
    """Rows at guided sites that had a valid record / rows at guided sites (1.0 when there are none).

    Rows of layers outside the layer policy are not guided sites and are left out (``FallbackCounter.coverage``)."""
    return counter.coverage


def guided_fallback_rate(counter: FallbackCounter, prefix: str = "quant") -> dict[str, float]:
    """Fraction of rows at guided sites that had no usable guidance (not-guided layers left out)."""
    return {f"{prefix}/guided_fallback_rate": 1.0 - guidance_coverage(counter)}


def guidance_step_metrics(counter: FallbackCounter, stats=None, prefix: str = "guidance") -> dict[str, float]:
    """THE per-step guidance log: ``{prefix}/coverage`` (at guided sites), ``{prefix}/rows_used``,
    ``{prefix}/fallback/{reason}`` for every reason (also ``not_guided_layer``), the fallback rate,
    and, given the plugin's ``TraceStep.stats()`` ``{(layer, site, reason): rows}``, per-site coverage
    ``{prefix}/coverage/{site}`` (one entry per site seen at a guided layer)."""
    out = {f"{prefix}/coverage": guidance_coverage(counter), f"{prefix}/rows_used": float(counter.used)}
    out.update({f"{prefix}/fallback/{k}": float(v) for k, v in sorted(counter.fallback.items())})
    out.update(guided_fallback_rate(counter))
    if stats:
        per_site: dict[str, FallbackCounter] = {}
        for (_, site, reason), n in stats.items():
            c = per_site.setdefault(site, FallbackCounter())
            c.add(n if reason == "used" else 0, None if reason == "used" else {reason: n})
        for site, c in sorted(per_site.items()):
            if c.used or any(k != NOT_GUIDED_REASON for k in c.fallback):
                out[f"{prefix}/coverage/{site}"] = guidance_coverage(c)
    return out


def cache_metrics(bytes_per_token: float, bytes_per_token_full: float | None = None,
                  prefix: str = "cache") -> dict[str, float]:
    """Guidance bytes per token (selected sites), and the same for full mode if given."""
    out = {f"{prefix}/bytes_per_token": float(bytes_per_token)}
    if bytes_per_token_full is not None:
        out[f"{prefix}/bytes_per_token_full"] = float(bytes_per_token_full)
    return out
