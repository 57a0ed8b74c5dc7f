"""TRACE experts: RNE mode equals an independent fake-quant computation; weights, GEMM paths, STE, training."""

import pytest
import torch
import torch.nn.functional as F

from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer, nvfp4
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_record, trace_spec
from megatron_trace.megatron.experts import TraceSequentialMLP
from megatron_trace.megatron.gemm import grouped_linear

from .harness import EXPERTS, batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")


def _model(tc=None, **cfg_kw):
    cfg = tiny_config(**cfg_kw)
    return build_model(cfg, trace_spec(stock_spec(cfg), tc or TraceConfig()))


def _capture_moe(model, layer, data):
    """Input [S, B, H] and output of layer ``layer``'s MoELayer in one forward."""
    seen = {}
    moe = model.decoder.layers[layer].mlp
    h = moe.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out[0].detach()))
    tokens, pos, mask, _ = data
    with torch.no_grad():
        model(tokens, pos, mask)
    h.remove()
    return seen["x"], seen["y"]


def _reference_moe(moe, x, per_row=True, glu=lambda gate, up: F.silu(gate) * up):
    """Independent: quantize each token before routing, loop over experts, combine like Megatron (bf16 adds).

    per_row=False: one amax over the layer's tokens (FC1) and over all its (token, expert) rows (FC2)."""
    act_q, w_q = Quantizer("nvfp4", per_row=per_row), Quantizer("nvfp4")
    S, B, H = x.shape
    tokens = x.reshape(S * B, H)
    with torch.no_grad():
        probs, routing = moe.router(x)
        xq = act_q.quantize(tokens).dequantize(tokens.dtype)  # once per token, before dispatch
        rows, hs = {}, {}
        for e in range(EXPERTS):
            rows[e] = routing[:, e].nonzero().squeeze(1)
            w1 = w_q.quantize(moe.experts.local_experts[e].linear_fc1.weight).dequantize(tokens.dtype)
            gate, up = F.linear(xq[rows[e]], w1).chunk(2, dim=-1)
            hs[e] = glu(gate, up)
        h_all = torch.cat(list(hs.values()))
        hq = act_q.quantize(h_all).dequantize(h_all.dtype).split([h.shape[0] for h in hs.values()])
        out = torch.zeros_like(tokens)
        for e in range(EXPERTS):
            w2 = w_q.quantize(moe.experts.local_experts[e].linear_fc2.weight).dequantize(tokens.dtype)
            y = (F.linear(hq[e], w2) * probs[rows[e], e].unsqueeze(-1)).to(tokens.dtype)
            out.index_add_(0, rows[e], y)
    return out.view(S, B, H)


@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("amax", ["per_row", "per_tensor"])
def test_rne_mode_equals_independent_fake_quant(layer, amax):
    model = _model(TraceConfig(activation_amax=amax, sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                               guided_sites=("expert_fc1_in", "expert_fc2_in")))
    x, y = _capture_moe(model, layer, batch())
    assert torch.equal(y, _reference_moe(model.decoder.layers[layer].mlp, x, per_row=amax == "per_row"))



def test_the_glu_clamp_and_linear_offset_are_megatrons():
    """``activation_func_clamp_value`` v and ``glu_linear_offset`` c (e.g. gpt-oss): silu(min(gate, v)) *
    (clamp(up, -v, v) + c), Megatron's own GLU, written out in the reference."""
    v, c = 0.1, 1.0
    model = _model(TraceConfig(sites=("expert_fc1_in", "expert_fc2_in", "weights"),
                               guided_sites=("expert_fc1_in", "expert_fc2_in")),
                   activation_func_clamp_value=v, glu_linear_offset=c)
    x, y = _capture_moe(model, 0, batch())
    glu = lambda gate, up: F.silu(gate.clamp(max=v)) * (up.clamp(-v, v) + c)  # noqa: E731
    assert torch.equal(y, _reference_moe(model.decoder.layers[0].mlp, x, glu=glu))
    assert not torch.equal(y, _reference_moe(model.decoder.layers[0].mlp, x))  # (the settings change the output)

def test_rne_mode_is_not_the_bf16_model():
    cfg = tiny_config()
    stock, model = build_model(cfg, stock_spec(cfg)), _model()
    x, y = _capture_moe(model, 1, batch())
    with torch.no_grad():
        y_stock = stock.decoder.layers[1].mlp(x)[0]  # the same input through Megatron's BF16 experts
    assert not torch.equal(y, y_stock)
    rel = (y.float() - y_stock.float()).norm() / y_stock.float().norm()
    assert 0.01 < rel < 0.3  # W4A4 noise, not garbage


def test_expert_weights_are_the_rollouts_codes():
    """Stacked quantization = per-expert NVFP4 (1x16 along K, per-tensor amax, RNE), like the rollout."""
    experts = _model().decoder.layers[0].mlp.experts
    w = torch.stack([e.linear_fc1.weight for e in experts.local_experts])  # [E, 2F, H]
    got = experts.quantize_weights(w)
    for e in range(EXPERTS):
        q = nvfp4.quantize(w[e])
        assert q.global_amax.dim() == 0 and q.block_scales.shape[-1] == w.shape[-1] // 16
        assert torch.equal(got[e], q.dequantize(w.dtype))


def test_mxfp4_experts_run_and_record():
    model = _model(TraceConfig(format="mxfp4"))
    with trace_record(model) as h:
        _capture_moe(model, 0, batch())
    rec = h.recorded().sites[(0, "expert_fc2_in")].record
    assert rec.fmt == "mxfp4" and rec.global_amax is None


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_path_equals_the_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w = torch.randn(4, 48, 64, generator=g).bfloat16()
    counts = [10, 0, 20, 7]
    loop = grouped_linear(x, w, counts, impl="loop")
    try:  # CPU support depends on the torch build: probe torch itself, so that an error of ours still fails
        torch._grouped_mm(x[:8], w[:1].transpose(-2, -1), offs=torch.tensor([8], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm unavailable on CPU in torch {torch.__version__}: {e}")
    mm = grouped_linear(x, w, counts, impl="grouped_mm")
    assert torch.allclose(mm.float(), loop.float(), rtol=1e-2, atol=1e-2)


def test_grouped_linear_checks_counts():
    with pytest.raises(ValueError, match="does not fit"):
        grouped_linear(torch.zeros(5, 16), torch.zeros(2, 8, 16), [2, 2])


@pytest.mark.parametrize("counts", [[1.5, 1.5], torch.tensor([1.6, 1.6]), [True, 2], [-1, 4], ["1", "2"]])
def test_grouped_linear_refuses_counts_that_are_no_ints_ge_0(counts):
    """int() took 1.5 as 1 and True as 1 (rows split among other experts; [True, 2] ran), -1 failed in
    torch.split; the error showed the truncated counts."""
    with pytest.raises(ValueError, match=r"tokens_per_expert=.* holds .*: row counts are ints >= 0"):
        grouped_linear(torch.zeros(3, 16), torch.zeros(2, 8, 16), counts, impl="loop")


def test_gradients_are_straight_through():
    """d/dW of the experts equals d/d(fake-quantized W) of the same graph built from detached FP4 values."""
    experts = _model().decoder.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 64, generator=g).bfloat16().requires_grad_()
    counts = torch.tensor([3, 0, 2, 1, 0, 4, 1, 1])
    probs = torch.rand(12, generator=g)
    gy = torch.randn(12, 64, generator=g).bfloat16()
    y, _ = experts(x, counts, probs)
    (y.float() * gy.float()).sum().backward()

    act_q, w_q = Quantizer("nvfp4", per_row=True), Quantizer("nvfp4")
    xq = act_q.quantize(x.detach()).dequantize(x.dtype).requires_grad_()
    def leaf(w):
        return w_q.quantize(w.detach()).dequantize(x.dtype).requires_grad_()

    w1 = [leaf(e.linear_fc1.weight) for e in experts.local_experts]
    w2 = [leaf(e.linear_fc2.weight) for e in experts.local_experts]
    outs = []
    for e, xe in enumerate(torch.split(xq, counts.tolist())):
        gate, up = F.linear(xe, w1[e]).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if h.shape[0]:  # (the formats reference does not take empty tensors)
            h = h + (act_q.quantize(h.detach()).dequantize(h.dtype) - h).detach()  # STE
        outs.append(F.linear(h, w2[e]))
    ref = (torch.cat(outs) * probs.unsqueeze(-1)).to(x.dtype)
    assert torch.equal(y, ref)
    (ref.float() * gy.float()).sum().backward()
    assert torch.allclose(x.grad.float(), xq.grad.float(), rtol=1e-2, atol=1e-3)
    for e, mlp in enumerate(experts.local_experts):
        assert torch.allclose(mlp.linear_fc1.weight.grad.float(), w1[e].grad.float(), rtol=1e-2, atol=1e-3)
        assert torch.allclose(mlp.linear_fc2.weight.grad.float(), w2[e].grad.float(), rtol=1e-2, atol=1e-3)
    assert all(mlp.linear_fc1.weight.grad.abs().sum() > 0 for i, mlp in enumerate(experts.local_experts) if counts[i])


def test_a_few_optimizer_steps_lower_the_loss_with_guidance():
    model = _model(TraceConfig(guided_layers="all"))
    tokens, pos, mask, labels = batch(seed=5)
    with trace_record(model) as h, torch.no_grad():
        model(tokens, pos, mask)
    step_guidance = h.recorded()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        step = StepGuidance(sites=step_guidance.sites, routing=step_guidance.routing)
        with trace_guidance(model, step) as ctx:
            loss = model(tokens, pos, mask, labels=labels).float().mean()
            loss.backward()
        assert ctx.counter.used > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_local_payload_permutation_equals_the_dispatcher(dispatcher):
    """EP = 1: guidance rows permuted locally == the same rows through the layer's dispatcher class, both ways."""
    model = _model(moe_token_dispatcher_type=dispatcher)
    experts = model.decoder.layers[0].mlp.experts
    assert experts._local_payload()
    g = torch.Generator().manual_seed(3)
    routing = torch.zeros(13, EXPERTS, dtype=torch.bool)  # 13 tokens, 2 experts each, token-major virtual rows
    for t in range(13):
        routing[t, torch.randperm(EXPERTS, generator=g)[:2]] = True
    virtual = routing.nonzero()
    payload = torch.randint(0, 256, (virtual.shape[0], 11), generator=g, dtype=torch.uint8)
    rows, counts = experts.dispatch_payload(payload, virtual[:, 1], EXPERTS, torch.float32)
    back = experts.combine_payload(rows.float())
    want_rows, want_counts = experts._dispatch_payload(payload, virtual[:, 1], EXPERTS, torch.float32)
    experts._payload_order = None
    want_back = experts.combine_payload(want_rows.float())
    assert torch.equal(rows, want_rows)
    assert torch.as_tensor(counts).tolist() == torch.as_tensor(want_counts).tolist()
    assert torch.equal(back, want_back) and torch.equal(back, payload.float())


def test_expert_options_trace_does_not_implement_are_named_at_build_time():
    from megatron_trace.megatron.experts import check_expert_config

    ep2 = tiny_config(expert_model_parallel_size=2)
    check_expert_config(ep2, TraceConfig())  # per-row amax: batch-invariant, any EP size
    check_expert_config(ep2, TraceConfig(format="mxfp4", activation_amax="per_tensor"))  # MXFP4 has no global amax
    check_expert_config(tiny_config(), TraceConfig(activation_amax="per_tensor"))
    check_expert_config(ep2, TraceConfig(activation_amax="per_tensor", sites=("expert_fc1_in", "weights"),
                                         guided_sites=("expert_fc1_in",)))  # FC1 carries its source rank's amax
    with pytest.raises(ValueError, match=r"per_tensor' with expert_model_parallel_size=2: .*\(use activation_amax"):
        check_expert_config(ep2, TraceConfig(activation_amax="per_tensor"))
    with pytest.raises(ValueError, match="add_bias_linear=True"):
        check_expert_config(tiny_config(add_bias_linear=True), TraceConfig())
    with pytest.raises(ValueError, match="moe_latent_size=32 "):  # (TE experts only: it needs TE's linears)
        check_expert_config(tiny_config(moe_latent_size=32), TraceConfig())
    # sequence parallel: a rank's MoE layer sees 1/TP of the tokens (per-tensor amax over them depends on TP)
    tp2 = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    check_expert_config(tp2, TraceConfig())
    check_expert_config(tp2, TraceConfig(format="mxfp4", activation_amax="per_tensor"))
    check_expert_config(tp2, TraceConfig(activation_amax="per_tensor", sites=("weights", "kv_k", "kv_v"),
                                         guided_sites=("kv_k", "kv_v")))  # (the KV site refuses TP on its own)
    for sites in (("expert_fc1_in", "weights"), ("expert_fc2_in", "weights")):
        with pytest.raises(ValueError, match=r"per_tensor' with tensor_model_parallel_size=2 and sequence_parallel"):
            check_expert_config(tp2, TraceConfig(activation_amax="per_tensor", sites=sites, guided_sites=sites[:1]))
    deferred = tiny_config()
    deferred.delay_wgrad_compute = True  # (its own checks need EP comm overlap; set after them)
    with pytest.raises(ValueError, match="delay_wgrad_compute=True"):
        check_expert_config(deferred, TraceConfig())


@pytest.mark.parametrize("kw,match", [
    (dict(moe_grouped_gemm=True, recompute_granularity="selective", recompute_modules=["core_attn", "moe_act"]),
     r"recompute_modules 'moe_act' \(the TRACE experts' forward does not checkpoint"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "expert_fc1", "moe_act"]),
     r"offload_modules \['expert_fc1', 'moe_act'\] \(the TRACE experts' forward does not offload"),
], ids=["recompute_moe_act", "offload_expert_inputs"])
def test_megatron_memory_options_inside_the_grouped_experts_are_refused_at_build_time(kw, match):
    """Megatron's grouped experts checkpoint their activation (``recompute_modules`` "moe_act", which Megatron allows
    with ``moe_grouped_gemm`` only: TRACE maps the legacy GroupedMLP to its torch experts) and offload their inputs
    (``offload_modules``) inside their own forward, which TRACE's replaces: the model was built and trained with the
    activations kept in device memory, silently. The rest of those options builds."""
    with pytest.raises(ValueError, match=match):
        _model(**kw)
    kept = {k: [m for m in v if m in ("core_attn", "moe")] if isinstance(v, list) else v for k, v in kw.items()}
    model = _model(**kept)  # the options the TRACE model honours: Megatron's, outside the experts
    assert isinstance(model.decoder.layers[0].mlp.experts, TraceSequentialMLP)
    stock = tiny_config(**kw)  # (Megatron's own config accepts them: only TRACE's experts refuse)
    assert stock.recompute_modules or stock.offload_modules


def test_a_router_that_would_raise_name_error_without_te_is_said_at_build_time(monkeypatch):
    """megatron-core 0.16.1's router reads moe_utils.te_general_gemm, defined only when TE imports: without TE (the
    H100 run of Megatron-LM's pretrain_gpt.py, session 42) the first forward raised NameError, TRACE or not. The
    TRACE experts now say so when the model is built, with the fix; once defined (TE, or the fix) they build."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_trace.megatron.experts import check_expert_config

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # as megatron-core leaves it without TE
    with pytest.raises(RuntimeError, match=r"te_general_gemm.*NameError.*fix_router_without_te\(\)"):
        check_expert_config(tiny_config(), TraceConfig())
    from megatron_trace.testing.megatron_cpu import fix_router_without_te

    fix_router_without_te()
    check_expert_config(tiny_config(), TraceConfig())
    assert moe_utils.te_general_gemm is None


@pytest.mark.parametrize("option, value, said", [
    ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input=True"),
    ("expert_tensor_parallel_size", 2, "expert_tensor_parallel_size=2 (supported: 1)"),
    ("fp8", "hybrid", "fp8/fp4 recipes"),
    ("fp4", "nvfp4", "fp8/fp4 recipes"),
    ("moe_token_dispatcher_type", "flex", "moe_token_dispatcher_type='flex' (supported: allgather, alltoall)"),
])
def test_each_unimplemented_expert_option_is_refused_on_its_own(option, value, said):
    """Each option alone (set after the config's own checks, which tie some of them to other options)."""
    from megatron_trace.megatron.experts import check_expert_config

    cfg = tiny_config()
    setattr(cfg, option, value)
    with pytest.raises(ValueError, match=r"TRACE experts do not support .*" + said.replace("(", r"\(").replace(
            ")", r"\)").replace(".", r"\.")):
        check_expert_config(cfg, TraceConfig())


def test_quantize_weights_is_each_expert_alone_and_leaves_an_excluded_layer_alone():
    from megatron_trace.megatron import find_trace_layers
    from megatron_trace.megatron.expert_weights import of, stacked

    model = _model(TraceConfig(exclude_modules=("model.layers.1.mlp.experts",)))
    find_trace_layers(model)
    for layer, excluded in ((0, False), (1, True)):
        experts = model.decoder.layers[layer].mlp.experts
        weights = of(experts.local_experts, "linear_fc2")
        with torch.no_grad():
            each = torch.cat([experts.quantize_weights(w[None]) for w in weights])
            assert torch.equal(each, experts.quantize_weights(stacked(weights)))
            assert torch.equal(each, stacked(weights)) == excluded, layer


def test_grouped_linear_square_experts_equal_each_rows_own_expert():
    """Square experts (M == K: a transposed weight still fits) and an empty group: row r of expert e is
    x[r] @ w[e].T on both paths; counts for fewer experts than w holds are refused, not run on the first ones."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=g).bfloat16()
    w = torch.randn(3, 16, 16, generator=g).bfloat16()
    counts = [5, 0, 7]
    owner = [0] * 5 + [2] * 7
    want = torch.stack([x[r].float() @ w[owner[r]].float().T for r in range(12)])
    impls = ["loop"] + (["grouped_mm"] if hasattr(torch, "_grouped_mm") else [])
    for impl in impls:
        try:
            got = grouped_linear(x, w, counts, impl=impl)
        except NotImplementedError:  # torch._grouped_mm without a CPU kernel in this build
            continue
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2), impl
        got_t = grouped_linear(x, w, torch.tensor(counts), impl=impl)  # counts as a tensor on x's device
        assert torch.equal(got_t, got), impl
    with pytest.raises(ValueError, match="does not fit"):
        grouped_linear(x, w, [5, 7], impl="loop")
    with pytest.raises(ValueError, match="2 counts for 3 experts"):
        grouped_linear(x, w, torch.tensor([5, 7]), impl="grouped_mm")
    with pytest.raises(ValueError, match=r"impl='cutlass' is not one of \('auto', 'loop', 'grouped_mm'\)"):
        grouped_linear(x, w, counts, impl="cutlass")
