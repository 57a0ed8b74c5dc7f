"""``HFRolloutBackend(compile=True | "layers")`` (``rollout.compiled``): the same generations as the eager backend,
and a bounded number of compiled graphs (no recompilation per decode step or per call once shapes went dynamic).

Run in a subprocess: the test process disables torch.compile (``tests/conftest.py``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trace.rollout import HFRolloutBackend

from ._tiny import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def run_compiled(*args: str) -> dict:
    """``tests/rollout/_compiled_run.py`` in a subprocess with torch.compile enabled: its JSON report."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="0", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "tests.rollout._compiled_run", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("compile", ["modules", "layers"])
def test_compiled_generations_equal_the_eager_ones(compile):
    got = run_compiled("cpu", compile)
    layers = tiny_config().num_hidden_layers
    # modules: per layer the input / post-attention / q / k norms and the router; layers: the decoder layers; and
    # the final norm
    names = got["fp4"]["modules"]
    assert len(names) == (5 * layers if compile == "modules" else layers) + 1 and "model.norm" in names
    for mode in ("fp4", "bf16"):  # fp4: the fused FP4-KV decode attention (deferred KV reads) inside the layers
        g = got[mode]
        assert all(g["same_tokens"]) and all(g["same_routing"]), (mode, g)
        # Inductor rounds where the eager modules round (emulate_precision_casts): only summation orders may
        # differ; on the CPU the log-probs came out equal or within 1e-4 (2026-12-01)
        assert max(g["logprob_diff"]) < 1e-2 and g["logits_rel_err"] < 1e-2, (mode, g)
        graphs = g["graphs"]  # the last call compiled nothing new (and no recompile limit was hit: see the runner)
        assert graphs[-1] == graphs[-2], (mode, graphs)
    # the grouped GPU path's routing / permutations / gate / weighted sum, compiled (Inductor's CPU backend here):
    # order, offs, inverse, sorted rows, gated rows, combined rows all bit-identical to the eager functions (run
    # once, beside "modules")
    assert compile == "layers" or all(all(row) for row in got["plumbing_equal"]), got["plumbing_equal"]
    # weights A -> B -> A on a compiled backend equals a fresh compiled A, parameters in place (nothing compiled in)
    assert got["refit"] == "ok", got["refit"]


@pytest.mark.parametrize("compile", [True, "layers"])
def test_compile_names_the_disabled_compiler(caplog, compile):
    # this process disables torch.compile: the backend says so instead of silently running eager
    with caplog.at_level(logging.WARNING, logger="megatron_trace.rollout.compiled"):
        be = HFRolloutBackend(tiny_model(), mode="bf16", compile=compile)
    assert "TORCHDYNAMO_DISABLE" in caplog.text
    assert be.compiled_modules == [] and not be.layers_compiled and not be._numerics(None).compiled
    assert not any(m._compiled_call_impl for m in be.model.modules())  # nothing claims to be compiled


def test_compile_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="compile='graphs' must be one of"):
        HFRolloutBackend(tiny_model(), mode="bf16", compile="graphs")


@pytest.mark.parametrize("compile_fn", ["compile_small_modules", "compile_layers"])
@pytest.mark.parametrize("dynamic", ["no", 0, 1.0])
def test_compile_names_a_dynamic_that_is_no_bool_or_none(compile_fn, dynamic):
    """Was passed on to torch.compile ("no" truthy: dynamic shapes), or silently dropped where compile is off."""
    from megatron_trace.rollout import compiled

    with pytest.raises(ValueError, match=f"dynamic={dynamic!r} must be None"):
        getattr(compiled, compile_fn)(tiny_model(), dynamic=dynamic)

def test_grouped_path_routing_helpers():
    """``fp4_moe``'s routing and row plumbing (eager; ``compiled=True`` runs the same functions through Inductor)
    against a direct computation: stable expert order, cumulative counts, inverse permutation, combine."""
    import torch

    from megatron_trace.rollout import fp4_moe

    g = torch.Generator().manual_seed(0)
    tokens, k, e, h = 11, 3, 6, 5
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    order, offs, inv = fp4_moe._routing(idx, e)
    flat = idx.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(offs, torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32))
    assert torch.equal(order[inv], torch.arange(tokens * k)) and torch.equal(inv[order], torch.arange(tokens * k))
    x = torch.randn(tokens, h, generator=g)
    rows = fp4_moe._sorted_rows(x, order, k)
    assert all(torch.equal(rows[i], x[p // k]) for i, p in enumerate(order.tolist()))  # pair p = (p // k, p % k)
    hsorted = torch.randn(tokens * k, 2 * h, generator=g)
    act = torch.empty(tokens * k, h)
    act[order] = fp4_moe.silu_and_mul(hsorted)  # (token, slot) order, as scattered before
    assert torch.equal(fp4_moe._gated_rows(hsorted, inv, fp4_moe.silu_and_mul), act)
    y, w = torch.randn(tokens * k, h, generator=g), torch.rand(tokens, k, generator=g)
    out = torch.empty_like(y)
    out[order] = y
    want = (out.view(tokens, k, h) * w.unsqueeze(-1)).sum(1)
    assert torch.equal(fp4_moe._combine(y, inv, w, torch.float32), want)


def test_routing_of_more_experts_than_an_int16_holds_and_a_bf16_combine_rounds_each_product():
    """``_routing_torch`` sorts 2-byte keys up to 2**15 experts only: ids past 32767 (here 40000 experts) keep their
    order (int64 keys). ``_combine_torch`` in bf16: each slot's router weight x output rounded to bf16, the slots
    summed in fp32, rounded once (the Triton combine's bits: ``tests/gpu/test_moe_combine_gpu.py``)."""
    import torch

    from megatron_trace.rollout import fp4_moe

    g = torch.Generator().manual_seed(1)
    e = 40000
    idx = torch.randint(0, e, (64, 4), generator=g)
    idx[:8] = torch.tensor([32767, 32768, 39999, 0])
    order, offs, inv = fp4_moe._routing_torch(idx, e)
    flat = idx.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(offs, torch.bincount(flat, minlength=e).cumsum(0).to(torch.int32))
    tokens, k, h = 6, 3, 64
    y = torch.randn(tokens * k, h, generator=g).bfloat16()
    w = torch.rand(tokens, k, generator=g)
    inv = torch.randperm(tokens * k, generator=g)
    want = torch.zeros(tokens, h)
    for t in range(tokens):
        for j in range(k):
            want[t] += (y[inv[t * k + j]] * w[t, j].bfloat16()).float()  # a bf16 product, an fp32 sum
    assert torch.equal(fp4_moe._combine_torch(y, inv, w, torch.bfloat16), want.bfloat16())
