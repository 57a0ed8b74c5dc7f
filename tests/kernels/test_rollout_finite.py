"""The rollout's Triton quantize calls with their NaN/Inf counters (``rollout.finite``): NaN / +-Inf at every site
are counted on the device (no error in the call) and named by layer and site at the one read, their dequantized
values stay NaN/Inf; finite inputs give the same codes, scales, amax, records and dequantized values as the
unchecked calls (before the counters) and as the reference, bit for bit.

CPU: Triton's interpreter (``TRITON_INTERPRET=1``), with the rollout's Triton paths forced on for CPU tensors
(``kv_rows._on_triton``, ``experts._fast_path``), as ``test_kv_write`` does.
"""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import FP4Tensor, NonFiniteError, Quantizer
from megatron_trace.rollout import kv_cache, kv_rows

from ..rollout._inject import VALUES, inject
from ..rollout._tiny import tiny_model
from ._gpu import DEVICE, INTERPRET, assert_same_fp4, edge_rows, needs_triton, random_rows, same_bits

pytestmark = needs_triton

if DEVICE is not None:
    from megatron_trace.kernels import fused, quant_triton
    from megatron_trace.kernels.checks import FiniteCounter
    from megatron_trace.rollout.finite import RolloutFiniteChecks
    from megatron_trace.rollout.fp4_moe import _quantize_dequantize

POLICIES = {"nvfp4-row": Quantizer("nvfp4", per_row=True), "nvfp4-tensor": Quantizer("nvfp4"),
            "mxfp4": Quantizer("mxfp4")}


@pytest.fixture(autouse=True)
def _triton_paths(monkeypatch):
    """Interpreter: IEEE division (its fma is unfused) and the KV cache's Triton path on CPU tensors."""
    if INTERPRET:
        monkeypatch.setattr(quant_triton, "FAST_DIV", False)
        monkeypatch.setattr(kv_rows, "_on_triton", lambda kernel, x, quantizer: kernel != "reference")


def _finite_rows(dtype) -> torch.Tensor:
    """[T, k=2, 64]: random rows of many scale regimes, then edge rows (ties, zeros, subnormal, huge)."""
    x = torch.cat([random_rows((6, 64), dtype, torch.Generator().manual_seed(1)), edge_rows(dtype)])
    return x[: x.shape[0] // 2 * 2].reshape(-1, 2, 64).to(DEVICE)


@pytest.fixture
def small_tiles(monkeypatch):
    """Interpreter: 64-element tiles for a whole generate (52-62 -> 7 s per test there, where a program of the launch
    configs' 2048-element tiles takes seconds). The tiles' bits are this file's bit-exact tests and test_quant_triton's
    pair-tile32 variant; the GPU keeps the launch configs."""
    if INTERPRET:
        monkeypatch.setattr(quant_triton, "CONFIG", {n: {"tile": 64, "num_warps": 4} for n in quant_triton.CONFIG})


@pytest.mark.parametrize("variant", ["pair", "elem", "pair-tile32", "pair-prefetch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_checked_activation_quantize_of_finite_rows_is_bit_exact(policy, dtype, variant, monkeypatch):
    """The experts' quantize pass with its counter: the same FP4 rows, record and dequantized rows as without it
    (the call before the counters) and as the reference; nothing counted."""
    monkeypatch.setattr(quant_triton, "PAIR_KERNEL", variant != "elem")
    if variant != "pair" and variant != "elem":
        extra = {"programs_per_sm": 2} if variant == "pair-prefetch" else {}
        monkeypatch.setattr(quant_triton, "CONFIG", {n: {"tile": 32 if variant == "pair-tile32" else 64,
                                                         "num_warps": 4, **(extra if n.startswith("pair") else {})}
                                                     for n in quant_triton.CONFIG})
    q = POLICIES[policy]
    x = _finite_rows(dtype)
    counter = FiniteCounter("layer 0 expert_fc2_in")
    got_q, got_rec, got_deq = _quantize_dequantize(x, q, True, counter)
    old_q, old_rec, old_deq = _quantize_dequantize(x, q, True)
    assert_same_fp4(got_q, old_q)
    assert_same_fp4(got_rec, old_rec)
    assert same_bits(got_deq, old_deq)
    ref = q.quantize(x.cpu())
    assert_same_fp4(got_q, ref)
    assert_same_fp4(got_rec, ref.guidance(compact=True))
    assert same_bits(got_deq, ref.dequantize(dtype))
    assert int(counter.tensor(DEVICE).item()) == 0


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_activation_quantize_counts_and_keeps_nonfinite(policy, value):
    """One NaN / +-Inf: counted on the device, no error in the call, kept in the dequantized rows (unchecked, a NaN
    came out finite: the code of +-6 or -0 with a finite scale), the other token rows as without it."""
    q = POLICIES[policy]
    x = random_rows((4, 2, 64), torch.bfloat16, torch.Generator().manual_seed(2)).to(DEVICE)
    clean = x.clone()
    x[1, 0, 9] = VALUES[value]
    counter = FiniteCounter("layer 2 expert_fc2_in")
    _, _, deq = _quantize_dequantize(x, q, True, counter)
    assert int(counter.tensor(DEVICE).item()) > 0
    if policy == "nvfp4-tensor":  # (an Inf in the tensor's own amax makes every value NaN, a NaN leaves a NaN)
        assert not torch.isfinite(deq[1, 0, 9])
        return
    assert same_bits(deq[1, 0, 9], x[1, 0, 9])
    rows = torch.tensor([0, 2, 3])
    assert same_bits(deq[rows], _quantize_dequantize(clean, q)[2][rows])
    if value == "nan":  # the unchecked call turns it into a finite value
        assert torch.isfinite(_quantize_dequantize(x, q)[2][1, 0, 9])


def _kv_steps(static: bool, bad: tuple[int, int, str, float] | None = None, finite=None):
    """A 2-layer FP4 KV cache (NVFP4 per row) fed a 3-token prefill and 3 decode tokens per layer; ``bad``: (step,
    layer, site, value) put into that K or V. Returns the cache."""
    q = POLICIES["nvfp4-row"]
    gen = torch.Generator().manual_seed(5)
    cache = kv_cache.FP4KVCache(2, q, finite=finite, fused_decode=True, static_rows=16 if static else None)
    for step in range(4):
        t = 3 if step == 0 else 1
        for layer in range(2):
            k, v = (random_rows((2, t, 2, 64), torch.bfloat16, gen).to(DEVICE).transpose(1, 2) for _ in range(2))
            if bad is not None and bad[:2] == (step, layer):
                (k if bad[2] == "kv_k" else v)[1, 0, -1, 7] = bad[3]
            if static and step:
                cache.decode_position().fill_(2 + step)
            cache.update(k, v, layer)
        if static and step:
            cache.advance(1)
    return cache


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_checked_kv_writes_of_finite_rows_are_bit_exact(static):
    """Prefill (its dequantized rows from the quantize pass), in-place decode writes / the static cache's kept row
    writer: the stored history equals the unchecked cache's; nothing counted."""
    checks = RolloutFiniteChecks()
    got, old = _kv_steps(static, finite=checks), _kv_steps(static)
    for layer in range(2):
        for site in ("kv_k", "kv_v"):
            assert_same_fp4(got.layers[layer].fp4_history(site), old.layers[layer].fp4_history(site))
    if static:
        assert got.layers[0]._rows["kv_v"]._writer[0].check_finite is checks.counter(0, "kv_v")
    assert checks.read() == []


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize(("step", "layer", "site"), [(0, 1, "kv_k"), (2, 0, "kv_v"), (3, 1, "kv_v")])
def test_nonfinite_kv_is_counted_and_named(step, layer, site, static):
    """A NaN / Inf in one token's K or V (the prefill, a decode write): no error in the call, named at the read.
    (NaN in the growing cache, -Inf in the static one: both at each place.)"""
    checks = RolloutFiniteChecks()
    _kv_steps(static, (step, layer, site, -float("inf") if static else float("nan")), finite=checks)
    with pytest.raises(NonFiniteError, match=rf"forward order: layer {layer} {site}: [1-9]\d*\)\."):
        checks.read()


def test_row_writer_counts_into_its_counter():
    q = POLICIES["mxfp4"]
    x = random_rows((2, 1, 3, 64), torch.bfloat16, torch.Generator().manual_seed(6)).to(DEVICE).transpose(1, 2)
    bufs = {"codes": torch.zeros(2, 3, 4, 32, dtype=torch.uint8, device=DEVICE),
            "scales": torch.zeros(2, 3, 4, 2, dtype=torch.uint8, device=DEVICE)}
    out = FP4Tensor(codes=bufs["codes"][:, :, :1], block_scales=bufs["scales"][:, :, :1].view(
        q.format.scale_dtype), global_amax=None, shape=tuple(x.shape), fmt="mxfp4")
    row = torch.zeros(1, dtype=torch.long, device=DEVICE)
    counter = FiniteCounter("layer 0 kv_k")
    writer = fused.RowWriter(x, q, out, row, check_finite=counter)
    assert writer.fits(x, q, row, counter) and not writer.fits(x, q, row) and not writer.fits(
        x, q, row, FiniteCounter("layer 0 kv_k"))
    writer(x)
    assert int(counter.tensor(DEVICE).item()) == 0
    x[1, 2, 0, 3] = float("nan")
    row.fill_(2)
    writer(x)
    assert int(counter.tensor(DEVICE).item()) > 0


@pytest.mark.parametrize(("site", "value"), [("expert_fc2_in", "nan"), ("kv_v", "+inf")])
def test_generate_on_the_triton_path_names_the_site(site, value, monkeypatch, small_tiles):
    """The hf backend's Triton path end to end (grouped experts on dense weights, Triton KV writes): a NaN put into
    the layer-1 fc2 rows (unchecked, it came out as a finite code: the batch and its records came back) or an Inf
    into layer-1 V fails the batch at its end, the site named first."""
    from megatron_trace.rollout import HFRolloutBackend, SamplingParams, experts

    monkeypatch.setattr(experts, "_fast_path", lambda num, hidden: True)
    monkeypatch.setattr(experts, "DENSE_FROM", 0)  # torch._grouped_mm on the dequantized weights (CPU too)
    be = HFRolloutBackend(tiny_model(), mode="fp4", trace_config=TraceConfig(guided_layers="all"),
                          dtype=torch.bfloat16, device=DEVICE)
    inject(be.model, 1, site, VALUES[value])
    with pytest.raises(NonFiniteError, match=rf"forward order: layer 1 {site}: [1-9]"):
        be.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1, seed=0))


def test_a_failed_generate_leaves_no_counts_to_the_next_one(monkeypatch):
    """Triton experts (counting) with SGLang's KV format (the reference quantize, raising in the call): a NaN in layer
    0's fc2 rows is counted and passed through, layer 1's K raises mid-generate. The count is read on the way out
    (a note on that error), so the next generate, with the producer fixed, returns (it used to raise naming layer 0's
    NaN of the failed batch)."""
    from megatron_trace.rollout import HFRolloutBackend, SamplingParams, experts

    monkeypatch.setattr(experts, "_fast_path", lambda num, hidden: True)
    monkeypatch.setattr(experts, "DENSE_FROM", 0)
    be = HFRolloutBackend(tiny_model(), mode="fp4", dtype=torch.bfloat16, device=DEVICE,
                          trace_config=TraceConfig(guided_layers="all", kv_format="sglang_kvfp4"))
    inject(be.model, 0, "expert_fc2_in", float("nan"))
    sampling = SamplingParams(max_new_tokens=1, seed=0)
    with pytest.raises(NonFiniteError, match="at layer 1 kv_k") as err:
        be.generate([[5, 6, 7]], sampling)
    assert any("layer 0 expert_fc2_in: 1" in note for note in err.value.__notes__)
    del be.model.model.layers[0].mlp.experts._apply_gate  # (inject's instance attribute: the producer fixed)
    assert be.generate([[5, 6, 7]], sampling).guidance
