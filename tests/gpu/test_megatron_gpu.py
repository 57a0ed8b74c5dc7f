"""The tiny Megatron MoE GPTModel with the TRACE spec (torch experts) on CUDA, bf16, Megatron unpatched
(NCCL world of 1; only ``megatron_without_te``, see _common).

- the grouped GEMM path (``torch._grouped_mm``) runs and equals the per-expert loop within bf16 rounding;
- logits and MoE outputs equal a CPU reference of the same weights (subprocess, CPU shims, formats reference):
  the GPU run guided by the CPU run's records reproduces every codeword, so the remaining difference is only
  GEMM accumulation order; the GPU's own RNE is reported (FP4 code flips make it larger);
- ``TraceConfig.kernel="triton"`` gives bit-identical logits to the reference fake-quant (own and guided);
- guided mode with records from a perturbed rollout: code mismatch 0 at every guided site.
Metrics go to the JSON-lines file ``$MEGATRON_TRACE_METRICS`` when set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ._common import DEVICE, megatron_without_te, metric, move_step, perturb_non_experts, rel_err

if DEVICE is None:
    pytest.skip("needs CUDA (or MEGATRON_TRACE_GPU_DRYRUN=1 for a CPU dry run)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.formats import e2m1  # noqa: E402
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec  # noqa: E402
from megatron_trace.megatron.gemm import _grouped_mm_ok, grouped_linear  # noqa: E402

from ..megatron.harness import (  # noqa: E402
    LAYERS,
    apply_cpu_shims,
    batch,
    build_model,
    destroy_parallel,
    free_port,
    init_parallel,
    stock_spec,
    tiny_config,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
SITES = ("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v")
KEYS = [(layer, s) for layer in range(LAYERS) for s in SITES]
GUIDED_ALL = TraceConfig(guided_layers="all", cache_mode="full")
STEP_SYNC_FILES = ("megatron/context.py", "megatron/facts.py", "megatron/step.py", "kernels/checks.py")  # the step's
# own host reads: the facts up front, the counts and checks at the exit


def _metric(name: str, value) -> None:
    metric("megatron_gpu", name, value)


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
        megatron_without_te()
        dist.init_process_group("nccl", rank=0, world_size=1)
    else:
        apply_cpu_shims()
        dist.init_process_group("gloo", rank=0, world_size=1)
    init_parallel(ep=1)
    yield
    destroy_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def weights(world):
    """One set of weights (bf16) for every model of this module."""
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), GUIDED_ALL))
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}  # _extra_state: None


def _model(weights, tc: TraceConfig = GUIDED_ALL):
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), tc)).to(DEVICE)
    model.load_state_dict(weights, strict=True)
    return model


def _data():
    return [t.to(DEVICE) for t in batch()]


def _run(model, data, step=None, record=True):
    """(logits, MoE outputs per layer, TraceStep)."""
    tokens, pos, mask, _ = data
    moe, hooks = {}, []
    for i, layer in enumerate(model.decoder.layers):
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, out, i=i: moe.__setitem__(i, out[0].detach())))
    with trace_guidance(model, step, record=record, compact=False) as h, torch.no_grad():
        logits = model(tokens, pos, mask)
    for hook in hooks:
        hook.remove()
    return logits, moe, h


def _values(sg):
    return e2m1.decode(e2m1.unpack(sg.record.codes.cpu()))[..., : sg.record.shape[-1]]


def mismatches(a, b) -> int:
    """Elements whose codeword differs (decoded values), over rows valid in both."""
    both = (a.valid.cpu() & b.valid.cpu()).unsqueeze(-1)
    va, vb = _values(a), _values(b)
    while both.dim() < va.dim():
        both = both.unsqueeze(-2)
    return int(((va != vb) & both).sum())


def test_grouped_mm_runs_and_equals_the_loop(weights):
    experts = _model(weights).decoder.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([40, 0, 17, 64, 1, 0, 30, 8])  # empty groups included
    n, hidden = int(counts.sum()), experts.config.hidden_size
    x = torch.randn(n, hidden, generator=g).to(DEVICE, torch.bfloat16)
    probs = torch.rand(n, generator=g).to(DEVICE)
    w1 = experts._stacked("linear_fc1").to(torch.bfloat16)
    if DEVICE == "cuda":
        assert _grouped_mm_ok(x, w1)  # "auto" takes torch._grouped_mm here
    fast = "grouped_mm" if DEVICE == "cuda" else "loop"
    y_fast = grouped_linear(x, w1, counts, fast)
    assert torch.equal(grouped_linear(x, w1, counts, "auto"), y_fast)
    exact = torch.cat([xe.double() @ w1[e].double().T for e, xe in enumerate(torch.split(x, counts.tolist()))])
    err_gemm = rel_err(y_fast, exact)
    assert err_gemm < 1e-2
    with torch.no_grad():
        experts.gemm_impl = "loop"
        y_loop, _ = experts(x, counts, probs)
        experts.gemm_impl = fast
        y_grouped, _ = experts(x, counts, probs)
    err = rel_err(y_grouped, y_loop)
    _metric("grouped_vs_loop_gemm_rel_err_vs_fp64", err_gemm)
    _metric("experts_grouped_vs_loop_rel_err", err)
    assert err < 1e-2


@pytest.fixture(scope="module")
def cpu_reference(weights, tmp_path_factory):
    """The CPU run of the same weights (formats reference, CPU shims, gloo) in a subprocess."""
    d = tmp_path_factory.mktemp("cpu_ref")
    torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in weights.items()}, d / "state.pt")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MEGATRON_TRACE_GPU_DRYRUN", None)
    proc = subprocess.run([sys.executable, "-m", "tests.gpu._cpu_reference", str(d / "state.pt"), str(d / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(d / "out.pt", weights_only=False)


def test_guided_by_the_cpu_records_matches_the_cpu_reference(weights, cpu_reference):
    ref = cpu_reference
    step = move_step(StepGuidance(sites=ref["sites"], routing=ref["routing"]), DEVICE)
    logits, moe, h = _run(_model(weights), _data(), step)
    got = h.recorded()
    for key in KEYS:
        assert mismatches(got.sites[key], ref["sites"][key]) == 0, key
        assert torch.equal(got.sites[key].record.block_scales.view(torch.uint8).cpu(),
                           ref["sites"][key].record.block_scales.view(torch.uint8)), key
    assert h.counter.used > 0 and not h.counter.fallback
    err = rel_err(logits, ref["logits"])
    err_moe = max(rel_err(moe[i], ref["moe"][i]) for i in range(LAYERS))
    _metric("guided_logits_rel_err_vs_cpu", err)
    _metric("guided_moe_out_max_rel_err_vs_cpu", err_moe)
    assert err < 1e-2 and err_moe < 2e-2


def test_own_rne_on_gpu_is_close_to_the_cpu_reference(weights, cpu_reference):
    """Same routing (replayed), own RNE on both sides: FP4 code flips where bf16 GEMMs differ by an ulp."""
    ref = cpu_reference
    step = move_step(StepGuidance(routing=ref["routing"]), DEVICE)
    logits, moe, h = _run(_model(weights), _data(), step)
    got = h.recorded()
    flips = {f"{k[0]}/{k[1]}": mismatches(got.sites[k], ref["sites"][k]) for k in KEYS}
    n = sum(int(ref["sites"][k].valid.sum()) * ref["sites"][k].record.shape[-1] for k in KEYS)
    err = rel_err(logits, ref["logits"])
    _metric("own_rne_logits_rel_err_vs_cpu", err)
    _metric("own_rne_code_flip_rate_vs_cpu", sum(flips.values()) / n)
    assert err < 5e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernels need CUDA")
def test_triton_kernel_gives_the_reference_logits_bit_for_bit(weights):
    data = _data()
    ref_model = _model(weights, GUIDED_ALL.replace(kernel="reference"))
    tri_model = _model(weights, GUIDED_ALL.replace(kernel="triton"))
    ref1, _, _ = _run(ref_model, data, record=False)
    ref2, _, _ = _run(ref_model, data, record=False)
    assert torch.equal(ref1, ref2)  # the model itself is deterministic
    tri, _, _ = _run(tri_model, data, record=False)
    assert torch.equal(tri, ref1)
    rollout = _model(weights)
    perturb_non_experts(rollout, 0.01)
    step = _run(rollout, data)[2].recorded()
    g_ref, _, _ = _run(ref_model, data, step, record=False)
    g_tri, _, _ = _run(tri_model, data, step, record=False)
    assert torch.equal(g_tri, g_ref)
    _metric("triton_vs_reference_logits_equal", True)


def test_guided_sites_reproduce_a_perturbed_rollout(weights):
    data = _data()
    rollout = _model(weights)
    perturb_non_experts(rollout, 0.01)
    roll = _run(rollout, data)[2].recorded()
    trainer = _model(weights)
    own = _run(trainer, data, StepGuidance(routing=roll.routing))[2].recorded()
    h = _run(trainer, data, StepGuidance(sites=roll.sites, routing=roll.routing))[2]
    guided = h.recorded()
    own_total = 0
    for key in KEYS:
        assert mismatches(guided.sites[key], roll.sites[key]) == 0, key
        own_total += mismatches(own.sites[key], roll.sites[key])
    assert own_total > 0
    assert h.coverage() == 1.0 and not h.counter.fallback
    _metric("perturbed_rollout_guided_mismatches", 0)
    _metric("perturbed_rollout_own_rne_mismatches", own_total)


def _project_syncs(fn) -> list[str]:
    """Source lines of megatron_trace that made ``fn()`` block the host (CUDA sync debug mode)."""
    import traceback
    import warnings

    pkg = str(ROOT / "megatron_trace")
    seen = []

    def record(message, *args, **kwargs):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(pkg)]
            if frames:
                seen.append(f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return seen


def test_qat_steps_block_the_host_only_at_the_step_boundary(weights):
    """Plain FP4 QAT forward + backward: no host sync from TRACE (NaN/Inf checks are deferred); a guided
    step: only the step's own resolutions (facts up front, counts and checks at the exit)."""
    data = _data()
    tokens, pos, mask, _ = data
    model = _model(weights, GUIDED_ALL.replace(kernel="triton"))  # full records: no per-step conversion
    rollout = _model(weights)
    perturb_non_experts(rollout, 0.01)
    roll = _run(rollout, data)[2].recorded()
    step = StepGuidance(sites={k: v for k, v in roll.sites.items()}, routing=roll.routing)

    def plain():
        model(tokens, pos, mask).float().mean().backward()

    def guided():
        with trace_guidance(model, step):
            model(tokens, pos, mask).float().mean().backward()

    plain(), guided()  # warm-up (Triton compiles)
    assert _project_syncs(plain) == []
    syncs = _project_syncs(guided)
    assert all(any(f in s for f in STEP_SYNC_FILES) for s in syncs), syncs
    assert len(syncs) <= 4, syncs
    _metric("guided_step_project_syncs", len(syncs))


def test_deferred_nan_check_names_the_site_and_keeps_the_nan(weights):
    from megatron_trace.formats import NonFiniteError
    from megatron_trace.megatron import check_finite

    tokens, pos, mask, _ = _data()
    model = _model(weights, GUIDED_ALL.replace(kernel="triton"))
    moe = model.decoder.layers[1].mlp
    hook = moe.register_forward_pre_hook(lambda m, args: (args[0].index_fill(0, torch.tensor([0], device=DEVICE),
                                                                             float("nan")),))
    with torch.no_grad():
        logits = model(tokens, pos, mask)  # no error inside the forward
    hook.remove()
    assert not torch.isfinite(logits).all()  # the NaN reached the loss instead of turning into FP4 codes
    with pytest.raises(NonFiniteError, match="layer 1 expert_fc1_in"):
        check_finite(model)
    check_finite(model)  # the counters were reset
    with pytest.raises(NonFiniteError, match="layer 1 expert_fc1_in"):
        with trace_guidance(model), torch.no_grad():
            h = moe.register_forward_pre_hook(lambda m, a: (a[0] * float("nan"),))
            try:
                model(tokens, pos, mask)
            finally:
                h.remove()


def test_one_context_over_the_schedule_with_host_guidance(weights):
    """Megatron's schedule over 4 micro-batches in one ``trace_guidance`` context, the guidance on the host (as the
    cache assembles it), full activation recompute: each micro-batch's codes are its own rollout's at every guided
    site (micro-batch 0's and 1's guidance swapped, they are not), and the layers' lazy copies of the records to
    the GPU block the host nowhere in a step that does not record (only the step's own resolutions do; recording
    runs the reference quantizer, which reads its valid rows on the host)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = 4
    micro = [[t.to(DEVICE) for t in batch(seed=s)] for s in range(n)]
    rollout = _model(weights)
    perturb_non_experts(rollout, 0.01)
    rolls = [_run(rollout, data)[2].recorded() for data in micro]
    host = [move_step(r, "cpu") for r in rolls]
    cfg = tiny_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model = build_model(cfg, trace_spec(stock_spec(cfg), GUIDED_ALL)).to(DEVICE)
    model.load_state_dict(weights, strict=True)

    def forward_step(data_iterator, model):
        tokens, pos, mask, labels = next(data_iterator)
        return model(tokens, pos, mask, labels=labels), lambda out: (out.float().mean(), {})

    def step(guidance, record=True):
        with trace_guidance(model, guidance, record=record, compact=False) as h:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                        num_microbatches=n, seq_length=micro[0][0].shape[1], micro_batch_size=2,
                                        forward_only=False)
        return h

    step(host, record=False)  # warm-up
    run = lambda: step(host, record=False)  # noqa: E731
    syncs = _project_syncs(run) if DEVICE == "cuda" else run() and []  # (the CPU dry run has no sync mode)
    assert all(any(f in s for f in STEP_SYNC_FILES) for s in syncs), syncs
    h = step(host)
    assert h.coverage() == 1.0 and not h.counter.fallback
    for i, roll in enumerate(rolls):
        got = h.microbatch(i).recorded()
        assert all(mismatches(got.sites[key], roll.sites[key]) == 0 for key in KEYS), i
    swapped = step([host[1], host[0], *host[2:]])
    assert sum(mismatches(swapped.microbatch(0).recorded().sites[key], rolls[0].sites[key]) for key in KEYS) > 0
    _metric("microbatch_queue_project_syncs", len(syncs))


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned memory needs CUDA")
def test_several_microbatches_keep_their_host_records_pinned(weights):
    """Full host records serving a compact config are converted to compact at the context entry; with several
    micro-batches every layer's host records, the converted ones included, are pinned once there, so no layer
    allocates pinned memory mid-forward to copy its micro-batch's records to the GPU."""
    import dataclasses

    from megatron_trace.formats import CompactGuidance
    from megatron_trace.megatron.layers import find_trace_layers

    rolls = [move_step(_run(_model(weights), [t.to(DEVICE) for t in batch(seed=s)])[2].recorded(), "cpu")
             for s in range(2)]
    model = _model(weights, TraceConfig(guided_layers="all", cache_mode="compact"))
    layers = find_trace_layers(model)
    with trace_guidance(model, rolls):
        sites = [c for m in layers.moe.values() for c in (m.experts._trace_step.fc1, m.experts._trace_step.fc2)]
        sites += [c for a in layers.kv.values() for c in a._trace_step.sites.values()]
        records = [c.sg.record for c in sites if c.sg is not None]
        tensors = [getattr(r, f.name) for r in records for f in dataclasses.fields(r)
                   if isinstance(getattr(r, f.name), torch.Tensor)]
        assert len(records) == len(KEYS) and all(isinstance(r, CompactGuidance) for r in records)
        assert tensors and all(t.is_pinned() and not t.is_cuda for t in tensors)
        with torch.no_grad():
            for s in range(2):
                model(*[t.to(DEVICE) for t in batch(seed=s)][:3])

