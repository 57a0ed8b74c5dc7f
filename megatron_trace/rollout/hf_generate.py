"""``HFRolloutBackend.generate``: the rollout loop of the embedded backend.

Prompts are left-padded internally; identical prompts are prefilled once and forked (``rollout.prefix``); then one
token per step is sampled and fed back (the eager loop, or fixed-buffer steps with ``static_decode``,
``rollout.static_decode``) until every row stops or ``max_new_tokens``; finally the internal columns become the
right-padded ``RolloutBatch`` with the recorder's routing and guidance (``GuidanceRecorder.finish``). Before that,
one host read takes the quantize sites' NaN/Inf counts and the NaN-logit flag (``rollout.finite``): a batch with
either raises ``NonFiniteError`` and returns nothing. A call that fails before that read reads the counts on its way
out (a note on its error names them), so they do not fail the next call.

Batch invariance: with ``TraceConfig.activation_amax="per_row"`` (the default; MXFP4 has no global amax) every
quantize site and the routing act per row: a row's codes, scales, amax and experts are a function of that row's input
alone, at any position of any batch, with prefix reuse or not, beside rows that stop early. The inputs themselves
come from torch's kernels, which round a batch of one or two rows and SDPA with or without a padding mask
differently from a larger batch. In fp32 (~1e-6) that shows in the log-probs and the NVFP4 per-row amax values, while
a greedy sample's tokens, routing and guidance codes, scales, valid rows and expert ids stayed bit-equal alone and in
batches in the tests; in bf16 (the default ``dtype``; one bf16 ulp) it also moves codes, block scales, expert choices
and greedy tokens (the tiny CPU model, 12 prompts alone vs together: 5 samples got other tokens; of the other 7,
codes differed at 41 of 84 (layer, site) records, block scales at 21, routing at 4 of 21 layers). That does not
misguide the trainer: a batch's records are the ones its tokens were sampled with. Not batch-invariant, by design
either: ``activation_amax="per_tensor"`` (one amax per forward over all its rows, left padding and finished rows
included: a sample's codes, routing and tokens depend on its batch; the recipe's ``activation_amax`` names it),
sampling at T > 0 (one generator per batch: ``SamplingParams.seed``), and ``static_decode`` against the growing cache
(equal within float rounding: its attention spans the static rows; in bf16 that rounding can move a token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..formats import NonFiniteError
from .base import RolloutBatch, SamplingParams, check_prompts
from .kv_cache import FP4KVCache
from .prefix import PrefixFork, fork_prefill, shared_prompts
from .recorder import GuidanceRecorder
from .sampling import sample_tokens
from .static_decode import StaticDecode

STATIC_DONE_CHECK = 8
"""With ``static_decode``, whether every row has stopped is read back every this many steps, not every step: the
read waits for the GPU, so the host could not queue the next replay meanwhile. The steps after the last stop feed
finished rows only (masked, not in the output: the same ``RolloutBatch``)."""


def generate(be, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> RolloutBatch:
    """``HFRolloutBackend.generate``: left-pad, prefill (once per distinct prompt), decode, assemble."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    limit = getattr(be.hf_config, "max_position_embeddings", None)
    prompts = check_prompts(prompts, be.vocab_size, max_positions=limit, max_new_tokens=sampling.max_new_tokens)
    sampling.check_vocab(be.vocab_size)
    b, dev = len(prompts), be.device
    plens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(plens.max())
    ids = torch.full((b, width), be.pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):  # left-pad internally
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
    ids, attn = ids.to(dev), (torch.arange(width).unsqueeze(0) >= (width - plens).unsqueeze(1)).to(dev)
    gen = torch.Generator(device=dev).manual_seed(sampling.seed) if sampling.seed is not None else None
    stop = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
    fork = shared_prompts(prompts) if be.prefix_reuse else None
    rows = b if fork is None else fork.num_unique
    recorder = GuidanceRecorder(rows, be.guided_sites, compact=be.config.cache_mode == "compact",
                                kernel=be.config.kernel)
    static_rows = None
    if be.static_decode != "off":  # the prompt, then one fed token per new token (rounded to 16 rows)
        static_rows = -(-(width + max(sampling.max_new_tokens, 1)) // 16) * 16
    cache = be.new_cache(recorder, interval_masks=True, static_rows=static_rows)  # left padding, finished tails
    with be.forward_context(recorder):
        try:
            steps = _decode(be, ids, attn, sampling, gen, stop, cache, recorder, fork)
        except BaseException as err:
            _read_counts_on_failure(be, err)
            raise
    if isinstance(cache, FP4KVCache):
        cache.check_interval_masks()
    return _assemble(be, ids, plens, steps, recorder)


def _read_counts_on_failure(be, err: BaseException) -> None:
    """A generate that raised before its read (an in-call error of the reference quantizer, an OOM, an interrupt):
    its sites' NaN/Inf counts are read and reset now, named in a note on ``err``, so that they do not fail the next
    call as if its batch held them."""
    try:
        be.finite_checks.read()
    except NonFiniteError as counted:
        err.add_note(f"the failed generate call's device counters, read on its way out: {counted}")
    except Exception as e:  # (the device itself may be what failed: the original error is raised)
        err.add_note(f"its NaN/Inf counters could not be read ({type(e).__name__}: {e})")


def _step(be, tokens, attn, pos, cache, recorder, valid):
    out = be.model(input_ids=tokens, attention_mask=attn.long(), position_ids=pos, use_cache=True,
                   logits_to_keep=1, **be.cache_kwargs(cache))
    recorder.end_step(valid)
    return out.logits[:, -1]


def _decode(be, ids, attn, sampling, gen, stop, cache, recorder, fork: PrefixFork | None = None):
    """Prefill, then one token per step. Returns tokens, logprobs, alive (each [B, n]) and done [B]."""
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    if fork is None:
        logits = _step(be, ids, attn, pos, cache, recorder, attn)
    else:  # identical prompts: prefill the first of each, then copy its state to every sample
        first = fork.first.to(ids.device)
        logits = _step(be, ids[first], attn[first], pos[first], cache, recorder, attn[first])
        logits = fork_prefill(fork, logits, cache, recorder)
    runner = None
    if be.static_decode != "off":
        runner = StaticDecode(be, cache, attn, pos[:, -1:], recorder)  # (every row's, forked or not)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    nonfinite = torch.zeros_like(done)  # rows with NaN/Inf logits, checked once at the end (no per-step sync)
    toks, lps, alives = [], [], []
    for i in range(sampling.max_new_tokens):
        tok, lp = sample_tokens(logits, sampling, gen, nonfinite)
        alive = ~done  # rows whose token at this step belongs to the response
        toks.append(torch.where(alive, tok, be.pad_token_id))
        lps.append(torch.where(alive, lp, 0.0))
        alives.append(alive)
        done = done | (alive & torch.isin(tok, stop))
        check = runner is None or (i + 1) % STATIC_DONE_CHECK == 0  # (reading ``done`` syncs with the GPU)
        last = i == sampling.max_new_tokens - 1 or (check and bool(done.all()))
        # feed the sampled token (after the last sample too, so every position has routing/guidance)
        if runner is not None:
            logits = runner.step(toks[-1].unsqueeze(1), alive)
            if be.static_decode == "graph" and runner.graph is None and not last:
                runner.capture(warmup=0)  # (the first step ran eagerly: it was the warm-up)
        else:
            attn = torch.cat([attn, alive.unsqueeze(1)], 1)
            pos = pos[:, -1:] + 1
            logits = _step(be, toks[-1].unsqueeze(1), attn, pos, cache, recorder, alive.unsqueeze(1))
        if last:
            break
    nonfinite |= ~torch.isfinite(logits.float()).all(dim=-1)  # the forward of the last fed token
    # one host read: the FP4 quantize sites' NaN/Inf counts (raised naming the sites) and the NaN-logit flag
    (bad_logits,) = be.finite_checks.read(nonfinite.any(), outcome="nothing of this generate call is returned (no "
                                          "tokens, log-probs or guidance)")
    if bad_logits:
        rows = nonfinite.nonzero().flatten().tolist()
        raise NonFiniteError(f"rollout produced NaN/Inf logits for {len(rows)} of {len(done)} prompt row(s) "
                             f"(first: {rows[:8]}): non-finite activations or weights upstream; nothing of this "
                             "batch is returned (no tokens, log-probs or guidance)")
    return torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(alives, 1), done


def _assemble(be, ids, plens, steps, recorder) -> RolloutBatch:
    """Internal left-padded columns -> right-padded output (see the RolloutBatch docstring)."""
    toks, lps, alive, done = steps
    dev, (b, width) = be.device, ids.shape
    plens = plens.to(dev)
    rlens = alive.sum(1)
    seq = int((plens + rlens).max())
    pos = torch.arange(seq, device=dev).unsqueeze(0)  # [1, S]
    internal = torch.cat([ids, toks], 1)  # [B, width + n]
    index = (pos + (width - plens).unsqueeze(1)).clamp(max=internal.shape[1] - 1)  # [B, S]
    valid = pos < (plens + rlens).unsqueeze(1)
    resp = valid & (pos >= plens.unsqueeze(1))
    tokens = torch.where(valid, internal.gather(1, index), be.pad_token_id)
    lp_internal = torch.cat([torch.zeros(b, width, device=dev), lps.float()], 1)
    logprobs = torch.where(resp, lp_internal.gather(1, index), 0.0)
    routing, guidance = recorder.finish(index, valid)
    reasons = tuple("stop" if bool(d) else "length" for d in done)
    return RolloutBatch(tokens=tokens, prompt_lens=plens, response_lens=rlens, response_mask=resp,
                        logprobs=logprobs, routing=routing, guidance=guidance,
                        policy_version=be.policy_version, pad_token_id=be.pad_token_id,
                        finish_reasons=reasons)
