"""GRPO pieces: group-normalised advantages and the token-level PPO-clip loss with truncated IS.

The rollout-correction weight (TIS) is ``min(exp(logp_old - logp_rollout), cap)`` (detached), where
``logp_old`` is the trainer's log-prob of the sampled token before the update and ``logp_rollout`` the
engine's; it corrects for the train-rollout mismatch that TRACE shrinks (paper: cap 5).
"""

from __future__ import annotations

import math

import torch

from ..rollout.base import is_int, is_real


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] (N = prompts * group_size, groups contiguous) -> advantages [N] (float32).

    A group whose rewards are all equal carries no signal and gets advantage 0 exactly (the float mean of equal
    values is not always that value, and ``(r - mean) / (std + eps)`` would then be a same-sign ~±1). ``group_size``
    is an int >= 1, ``eps`` a finite number >= 0; a NaN or infinite reward is refused (it made its whole group's
    advantages, and the loss, NaN)."""
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 (responses per prompt)")
    if not is_real(eps) or not 0 <= eps < math.inf:
        # (a negative eps below a group's std flipped the sign of its advantages: the worse response was reinforced)
        raise ValueError(f"eps={eps!r} must be a finite number >= 0 (added to each group's std)")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()=} is not a multiple of {group_size=}")
    bad = (~torch.isfinite(rewards.reshape(-1))).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards hold {len(bad)} NaN/Inf value(s), e.g. at {bad[:8]}: "
                         f"{rewards.reshape(-1)[bad[:8]].tolist()}; every reward must be finite")
    r = rewards.double().reshape(-1, int(group_size))
    if not r.numel():  # no groups (std over none warns)
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    # a group beyond 1 scaled down by a power of two to |r| < 1 (eps with it): the same advantages bit for bit, but no
    # overflow in the sum or the squares (float64 rewards beyond ~1e154 made the std inf, the group's advantages 0)
    exponent = torch.frexp(r.abs().amax(1, keepdim=True)).exponent.clamp(min=0)
    scale = torch.ldexp(torch.ones_like(r[:, :1]), -exponent)
    r = r * scale
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps * scale)
    constant = (r == r[:, :1]).all(1, keepdim=True)
    return torch.where(constant, 0.0, adv).float().view(-1)


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    tis_cap: float | None = 5.0,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
    stats: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss, averaged over all response tokens of the batch.

    logp, logp_old, logp_rollout, mask: [B, T] (mask = response tokens); advantages: [B]. Positions outside the
    mask take no part, whatever they hold (an engine's NaN / -inf at prompt or padding positions included).
    ``num_tokens``: divide by this many tokens instead of the mask's (a micro-batch's share of the loss of the
    batch that has ``num_tokens`` response tokens; the stats are shares too). ``stats=False``: no stats (they are
    read on the host: a device sync each).
    """
    shapes = {"logp_old": logp_old, "logp_rollout": logp_rollout, "mask": mask,
              **({} if logp_ref is None else {"logp_ref": logp_ref})}
    bad = {k: tuple(v.shape) for k, v in shapes.items() if v.shape != logp.shape}
    if logp.dim() != 2 or bad or tuple(advantages.shape) != tuple(logp.shape[:1]):
        # (they would broadcast: advantages [B, 1] or [B, T] against [B, T] made a [B, B, T] loss, silently wrong)
        raise ValueError(f"policy_loss takes logp [B, T] = {tuple(logp.shape)}, the same shape for {sorted(shapes)}"
                         f" (got {bad}) and advantages [B] (got {tuple(advantages.shape)}): one per sequence")
    _check_loss_settings(clip_eps, tis_cap, kl_coef)
    if kl_coef and logp_ref is None:  # (the KL term was dropped without a word)
        raise ValueError(f"kl_coef={kl_coef!r} needs logp_ref (the reference policy's log-probs [B, T]); "
                         "kl_coef=0 for no KL term")
    sel = mask.bool()
    # outside the mask every reference log-prob is replaced by logp itself (ratio 1, weight 1, KL 0), so that
    # NaN / inf there reach neither the loss nor, through 0 * inf, the gradient
    logp_old = torch.where(sel, logp_old, logp).detach()
    ratio = torch.exp(logp - logp_old)
    adv = advantages.detach().unsqueeze(1)  # (constants of the objective, as the TIS weight: no gradient reaches them)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_tok = -surrogate
    if tis_cap is not None:
        # detached: a logp_rollout that carries a gradient (the trainer's logp passed as the rollout's) cancelled the
        # ratio, and the loss's gradient was 0
        per_tok = per_tok * torch.exp(logp_old - torch.where(sel, logp_rollout, logp_old).detach()).clamp(max=tis_cap)
    if kl_coef and logp_ref is not None:
        d = torch.where(sel, logp_ref, logp).detach() - logp
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)  # k3 estimator
    if num_tokens is not None and num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0 (None: the mask's)")
    n = sel.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1)
    loss = torch.where(sel, per_tok, 0.0).sum() / n
    if not stats:
        return loss, {}
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        out = {"rl/clip_frac": float(torch.where(sel, clipped, 0.0).sum() / n),
               "rl/ratio_mean": float(torch.where(sel, ratio, 0.0).sum() / n)}
    return loss, out


def _check_loss_settings(clip_eps, tis_cap, kl_coef) -> None:
    """Refuse what ``policy_loss`` cannot mean: a negative or NaN ``clip_eps`` clamped every ratio to 1 + eps (torch's
    clamp with min > max), a ``tis_cap`` <= 0 weighted every token 0 or flipped its sign, a negative ``kl_coef``
    rewarded drifting from the reference; NaN made the loss NaN and a bool was taken as 0 / 1, all without a word."""
    if not (is_real(clip_eps) and 0 <= clip_eps < math.inf):
        raise ValueError(f"clip_eps={clip_eps!r} must be a finite number >= 0 (the PPO clip range: ratios outside "
                         "[1 - clip_eps, 1 + clip_eps] are clipped)")
    if tis_cap is not None and not (is_real(tis_cap) and tis_cap > 0):
        raise ValueError(f"tis_cap={tis_cap!r} must be None (no TIS weight) or a number > 0 (the cap of the "
                         "truncated IS weight)")
    if not (is_real(kl_coef) and 0 <= kl_coef < math.inf):
        raise ValueError(f"kl_coef={kl_coef!r} must be a finite number >= 0 (0: no KL term)")
