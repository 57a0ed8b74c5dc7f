"""GRPO pieces: group-normalised advantages and the token-level PPO-clip loss with truncated IS.

The rollout-correction weight (TIS) is ``min(exp(logp_old - logp_rollout), cap)`` (detached), where
``logp_old`` is the trainer's log-prob of the sampled token before the update and ``logp_rollout`` the
engine's; it corrects for the train-rollout mismatch that TRACE shrinks (paper: cap 5).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] (N = prompts * group_size, groups contiguous) -> advantages [N]."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()=} is not a multiple of {group_size=}")
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)).view(-1)


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss, averaged over all response tokens of the batch.

    logp, logp_old, logp_rollout, mask: [B, T] (mask = response tokens); advantages: [B].
    """
    m = mask.float()
    ratio = torch.exp(logp - logp_old.detach())
    adv = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_tok = -surrogate
    if tis_cap is not None:
        w = torch.exp(logp_old.detach() - logp_rollout).clamp(max=tis_cap)
        per_tok = per_tok * w
    if kl_coef and logp_ref is not None:
        d = logp_ref.detach() - logp
        per_tok = per_tok + kl_coef * (torch.exp(d) - d - 1)  # k3 estimator
    n = m.sum().clamp(min=1)
    loss = (per_tok * m).sum() / n
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {"rl/clip_frac": float((clipped * m).sum() / n), "rl/ratio_mean": float((ratio * m).sum() / n)}
    return loss, stats
