"""Token sampling with temperature and top-p, returning the log-probs of the sampled tokens.

Log-probs are those of the temperature-scaled distribution ``log_softmax(logits / T)`` before
top-p truncation (what a trainer recomputes from its own logits divided by the same T); with
greedy decoding (T = 0) they are ``log_softmax(logits)``.
"""

from __future__ import annotations

import torch

from .base import SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches ``top_p`` ([B, V])."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros((), dtype=probs.dtype, device=probs.device))
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    nonfinite: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens int64 [B], logprobs float32 [B]).

    ``nonfinite`` (bool [B], on the logits' device): rows whose logits hold NaN/Inf are OR-ed into it without a
    host sync, and such rows sample from a uniform distribution instead of failing inside ``multinomial`` (a
    device-side assert on CUDA); their log-probs stay non-finite. The caller checks the flags once per batch.
    """
    if not isinstance(params, SamplingParams):  # (a dict: AttributeError 'greedy')
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    # (host shapes only: 1-D logits sampled one scalar token, a nonfinite flag of other rows failed deep in torch)
    if logits.dim() != 2 or nonfinite is not None and (nonfinite.dtype != torch.bool
                                                        or tuple(nonfinite.shape) != (logits.shape[0],)):
        raise ValueError(f"sample_tokens needs logits [B, V] and nonfinite None or bool [B], got logits "
                         f"{tuple(logits.shape)}" + ("" if nonfinite is None else
                                                     f", nonfinite {nonfinite.dtype} {tuple(nonfinite.shape)}"))
    logits = logits.float()
    if nonfinite is not None:
        nonfinite |= ~torch.isfinite(logits).all(dim=-1)
    if params.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = top_p_filter(logp.exp(), params.top_p)
        if nonfinite is not None:
            probs = torch.where(nonfinite[:, None], torch.ones((), dtype=probs.dtype, device=probs.device), probs)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
