"""Run in a subprocess by the compile tests (the test process disables torch.compile): generate with and without
``HFRolloutBackend(compile=True)`` and print what the tests compare, as JSON.

``python -m tests.rollout._compiled_run [cuda]``: on CUDA (bf16, the grouped GPU path) also a forward's logits and
a compiled decode step replayed in a CUDA graph against the same step run eagerly."""

from __future__ import annotations

import json
import sys

import torch
import torch._dynamo.utils as dynamo_utils

from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.kv_cache import FP4KVCache
from tests.rollout._tiny import tiny_config, tiny_model

CALLS = ((3, 8), (2, 5), (4, 9))
"""(batch, new tokens) of the generate calls, new shapes in each: the last must compile nothing new (the shapes went
dynamic in the second)."""
GPU_MODEL = dict(hidden_size=256, moe_intermediate_size=128, head_dim=64, num_experts=16, num_experts_per_tok=4,
                 num_hidden_layers=3, vocab_size=512)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _graph_replay(be: HFRolloutBackend) -> float:
    """A decode step captured in a CUDA graph (after an eager step at the same shapes) vs that eager step."""
    from tests.gpu._common import capture_decode_step

    ids = torch.randint(3, be.vocab_size, (2, 40), device="cuda")
    tok = torch.randint(3, be.vocab_size, (2, 1), device="cuda")
    pos = torch.full((2, 1), 40, device="cuda")
    g, out, want, _ = capture_decode_step(
        be, lambda: FP4KVCache(be.num_layers, be.config.activation_quantizer(), fused_decode=be.fused_kv_attention),
        ids, tok, pos)
    g.replay()
    torch.cuda.synchronize()
    return _rel(out, want)


def _grouped_moe() -> dict:
    """``fp4_moe.grouped_experts_forward`` with ``compiled`` on and off (packed FP4 weights, both sites
    quantized): how far the outputs and the fc2 activation codes are apart."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.formats import Quantizer
    from megatron_trace.rollout.fp4_moe import grouped_experts_forward

    gen = torch.Generator(device="cuda").manual_seed(7)
    e, h, ffn, tokens, k = 16, 512, 256, 37, 4
    wq = Quantizer("nvfp4")
    fc1 = wq.quantize(torch.randn(e, 2 * ffn, h, generator=gen, device="cuda") * h**-0.5)  # packed [E, N, K]
    fc2 = wq.quantize(torch.randn(e, h, ffn, generator=gen, device="cuda") * ffn**-0.5)
    hidden = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=gen, device="cuda")[:k] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, k, generator=gen, device="cuda"), -1)
    aq = TraceConfig().activation_quantizer()
    a, b = (grouped_experts_forward(hidden, idx, wts, fc1, fc2, activation_quantizer=aq, compiled=c)
            for c in (False, True))
    return {"moe_rel_err": _rel(b.out, a.out), "moe_equal_fraction": float((a.out == b.out).float().mean()),
            "moe_fc2_codes_equal_fraction": float((a.fc2_in.codes == b.fc2_in.codes).float().mean())}


def _plumbing(device: str) -> dict:
    """``fp4_moe``'s routing and row plumbing compiled (``compiled=True``) against the eager functions, bf16 rows,
    at three shapes (the third after the first two made Inductor's shapes dynamic): equal bit for bit?"""
    from megatron_trace.rollout import fp4_moe

    eager, comp = fp4_moe._EAGER, fp4_moe._compiled_ops()
    g = torch.Generator().manual_seed(1)
    same = []
    for tokens, k, e, h in ((9, 2, 8, 32), (13, 2, 8, 32), (21, 4, 16, 32)):
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(device)
        x = torch.randn(tokens, h, generator=g).to(device, torch.bfloat16)
        hs = torch.randn(tokens * k, 2 * h, generator=g).to(device, torch.bfloat16)
        w = torch.rand(tokens, k, generator=g).to(device)
        outs = []
        for routing, sorted_rows, gated_rows, combine in (eager, comp):
            order, offs, inv = routing(idx, e)
            outs.append((order, offs, inv, sorted_rows(x, order, k), gated_rows(hs, inv, fp4_moe.silu_and_mul),
                         combine(hs[:, :h], inv, w, torch.bfloat16)))
        same.append([torch.equal(a, b) for a, b in zip(*outs)])
    return {"plumbing_equal": same}


def _refit(compile) -> dict:
    """``refit_self_test`` (A -> B -> A vs a fresh A, in place) on compiled backends: compiled code must not keep
    the weights it was compiled with."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.hf_weights import checkpoint_tensors
    from megatron_trace.rollout.refit import RefitError, refit_self_test

    cfg = TraceConfig(guided_layers="all", cache_mode="full")

    def make(seed=9):
        return lambda: HFRolloutBackend(tiny_model(seed=seed), mode="fp4", trace_config=cfg, compile=compile)

    a, b = (list(checkpoint_tensors(tiny_model(seed=s))) for s in (1, 2))
    try:
        refit_self_test(make(), a, b, [[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_new_tokens=4, seed=3),
                        fresh_a=make(seed=1)())
        return {"refit": "ok"}
    except RefitError as e:
        return {"refit": str(e)[:2000]}


def _generations(mode: str, compile, device: str, model) -> dict:
    """Eager vs compiled backends of one mode: generations over ``CALLS`` and a forward's logits."""
    res, graphs, logits, report = {}, [], {}, {}
    ids = torch.randint(3, 128, (3, 12), generator=torch.Generator().manual_seed(0)).to(device)
    for compiled in (False, compile):
        be = HFRolloutBackend(model(), mode=mode, compile=compiled, device=device, fused_kv_attention=True)
        for i, (b, n) in enumerate(CALLS):
            prompts = [[5 + j, 6, 7, 8 + j, 9][: 2 + (i + j) % 4] for j in range(b)]
            res[(bool(compiled), i)] = be.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0, seed=0))
            if compiled:
                graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        with be.forward_context() as m:
            logits[bool(compiled)] = m(input_ids=ids, use_cache=True, **be.cache_kwargs(be.new_cache())).logits
        if compiled:
            report["modules"] = be.compiled_modules
            if device == "cuda" and mode == "fp4":
                report["graph_replay_rel_err"] = _graph_replay(be)
    pairs = [(res[(False, i)], res[(True, i)]) for i in range(len(CALLS))]
    report.update(
        same_tokens=[torch.equal(a.tokens, b.tokens) for a, b in pairs],
        logprob_diff=[float((a.logprobs - b.logprobs).abs().max()) for a, b in pairs],
        same_routing=[all(torch.equal(a.routing[k], b.routing[k]) for k in a.routing) for a, b in pairs],
        logits_rel_err=_rel(logits[True], logits[False]), graphs=graphs)
    return report


def main(device: str = "cpu", compile: str = "modules") -> None:
    """JSON: per mode (fp4, bf16) the generations report, and the plumbing / refit / GPU checks. A dynamo
    recompile-limit hit fails the run (it would silently fall back to eager)."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    cuda = device == "cuda"
    model = (lambda: tiny_model(tiny_config(**GPU_MODEL), seed=3)) if cuda else tiny_model
    compile = True if compile == "modules" else compile
    report = {mode: _generations(mode, compile, device, model) for mode in ("fp4", "bf16")}
    if compile is True or cuda:  # (the plumbing's compiled functions are the same whatever the backend compiles)
        report.update(_plumbing(device))
    if cuda:
        report.update(_grouped_moe())
    else:
        report.update(_refit(compile))
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
