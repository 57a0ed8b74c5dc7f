"""``reuse_weight_quant``: the experts' fake-quantized weights computed once for several micro-batches give
the same gradients, bit for bit, as quantizing them in every micro-batch."""

import logging
import types
from contextlib import nullcontext

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, reuse_weight_quant, trace_guidance, trace_record, trace_spec

from .harness import batch, build_model, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")


def _model(**trace):
    cfg = tiny_config()
    return build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(**trace)))


def _grads(model, micro, reuse: bool, guidance=None):
    model.zero_grad(set_to_none=True)
    experts = [m for m in model.modules() if hasattr(m, "_weight_reuse")]
    with reuse_weight_quant(model) if reuse else nullcontext():
        for data in micro:
            if guidance is None:
                model(*data[:3], labels=data[3]).float().mean().backward()
            else:
                with trace_guidance(model, StepGuidance(sites=guidance.sites, routing=guidance.routing)):
                    model(*data[:3], labels=data[3]).float().mean().backward()
        if reuse:  # the weights of both GEMMs were kept by the first micro-batch and served the others
            assert all(set(m._weight_reuse) == {"linear_fc1", "linear_fc2"} for m in experts)
            # kept as values: no micro-batch's autograd graph (its saved tensors) lives on until the scope exits
            assert all(kept.grad_fn is None for m in experts for _, kept in m._weight_reuse.values())
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reused_weights_give_the_same_gradients(fmt):
    model = _model(format=fmt)
    micro = [batch(seed=s) for s in range(3)]
    want = _grads(model, micro, reuse=False)
    got = _grads(model, micro, reuse=True)
    assert set(got) == set(want) and any("local_experts" in n for n in got)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert all(m._weight_reuse is None for m in model.modules() if hasattr(m, "_weight_reuse"))  # scope closed


def test_guided_micro_batches_reuse_too():
    model = _model(guided_layers="all")
    data = batch(seed=5)
    with trace_record(model) as h, torch.no_grad():
        model(*data[:3])
    roll = h.recorded()
    want = _grads(model, [data, data], reuse=False, guidance=roll)
    got = _grads(model, [data, data], reuse=True, guidance=roll)
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_an_update_inside_the_scope_raises():
    model = _model()
    data = batch()
    expert = next(p for n, p in model.named_parameters() if "local_experts" in n)
    with pytest.raises(RuntimeError, match="changed inside reuse_weight_quant"), reuse_weight_quant(model):
        model(*data[:3], labels=data[3]).float().mean().backward()
        with torch.no_grad():
            expert.mul_(0.5)  # what an optimizer step would do
        model(*data[:3], labels=data[3])


def test_a_weight_re_seated_inside_the_scope_raises():
    """``param.data = ...`` (a module ``.to()`` that copies, a re-seat into another buffer) leaves the parameter's
    version counter as it was; the storage address tells the kept value is stale."""
    model = _model()
    data = batch()
    expert = next(p for n, p in model.named_parameters() if "local_experts" in n)
    with pytest.raises(RuntimeError, match="changed inside reuse_weight_quant"), reuse_weight_quant(model):
        model(*data[:3], labels=data[3]).float().mean().backward()
        version = expert._version
        expert.data = expert.data * 0.5
        assert expert._version == version  # (what a version check alone would miss)
        model(*data[:3], labels=data[3])


def test_clipped_ste_and_nesting_are_refused():
    with pytest.raises(ValueError, match="ste_clip=False"), reuse_weight_quant(_model(ste_clip=True)):
        pass
    model = _model()
    with reuse_weight_quant(model), pytest.raises(RuntimeError, match="do not nest"), reuse_weight_quant(model):
        pass


def test_megatron_lm_train_step_scope_follows_the_flags():
    """What the Megatron-LM patch does around forward_backward_func in train_step."""
    import argparse

    from megatron_trace.megatron import add_trace_args, trace_train_step

    model = _model()
    experts = [m for m in model.modules() if hasattr(m, "_weight_reuse")]
    parse = lambda flags: add_trace_args(argparse.ArgumentParser()).parse_args(flags)  # noqa: E731
    data = batch()
    for flags, reused in (([], False), (["--trace-fp4"], False), (["--trace-fp4", "--trace-reuse-weight-quant"], True)):
        with trace_train_step(parse(flags), [model]):  # Megatron-LM passes its list of model chunks
            for _ in range(2):
                model(*data[:3], labels=data[3]).float().mean().backward()
            assert all(bool(m._weight_reuse) == reused for m in experts), flags
        assert all(m._weight_reuse is None for m in experts)


def test_a_pipeline_stage_without_trace_sites_runs_a_plain_step(caplog):
    """A stage of dense layers only (moe_layer_freq) with K/V unquantized has no TRACE module: the step hook
    passes it through; the same stage with K/V quantized but built without the TRACE spec is an error."""
    import argparse

    from megatron_trace.megatron import add_trace_args, trace_spec_from_args, trace_train_step

    parse = lambda flags: add_trace_args(argparse.ArgumentParser()).parse_args(flags)  # noqa: E731
    experts_only = parse(["--trace-fp4", "--trace-sites", "expert_fc1_in,expert_fc2_in,weights"])
    cfg = tiny_config(num_layers=2, moe_layer_freq=[0, 0])  # the dense first stage of a pipeline
    model = build_model(cfg, trace_spec_from_args(experts_only, stock_spec(cfg)))
    data = batch()
    for flags in (experts_only, parse(["--trace-fp4", "--trace-sites", "expert_fc1_in,weights",
                                       "--trace-reuse-weight-quant"])):
        with caplog.at_level(logging.INFO, logger="megatron_trace.megatron.train_step"):
            caplog.clear()
            for _ in range(3):  # the stage is looked at once per run (args), not every step
                with trace_train_step(flags, [model]):
                    model(*data[:3], labels=data[3]).float().mean().backward()
        assert [r.getMessage() for r in caplog.records] == [
            "--trace-fp4: this pipeline stage has no MoE layer and K/V are not quantized: nothing to check"]
    with trace_train_step(types.SimpleNamespace(**vars(experts_only)), [model]):  # a namespace without weakrefs
        model(*data[:3], labels=data[3]).float().mean().backward()
    with pytest.raises(ValueError, match="no TRACE modules"), trace_train_step(parse(["--trace-fp4"]), [model]):
        model(*data[:3], labels=data[3]).float().mean().backward()


def test_a_pipeline_stage_without_decoder_layers_runs_a_plain_step(caplog):
    """A pipeline layout's stage may hold no decoder layer ("E|t*4|L": the loss-only stage; "...|mL": a standalone
    MTP stage, whose MoE layer keeps the stock spec): no TRACE module, K/V quantized or not, is a plain step."""
    import argparse
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from megatron_trace.megatron import add_trace_args, trace_spec_from_args, trace_train_step

    from .harness import SEQ, VOCAB

    parse = lambda flags: add_trace_args(argparse.ArgumentParser()).parse_args(flags)  # noqa: E731
    data = batch()
    args = parse(["--trace-fp4"])  # K/V quantized (the default sites)
    cfg = tiny_config()
    model = build_model(cfg, trace_spec_from_args(args, dataclasses.replace(stock_spec(cfg), layer_specs=[])))
    with caplog.at_level(logging.INFO, logger="megatron_trace.megatron.train_step"), trace_train_step(args, [model]):
        model(*data[:3], labels=data[3]).float().mean().backward()
    assert "this pipeline stage has no decoder layer" in caplog.text
    experts_only = parse(["--trace-fp4", "--trace-sites", "expert_fc1_in,expert_fc2_in,weights"])
    cfg = tiny_config(mtp_num_layers=1)
    moe_layer = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, moe_layer, use_transformer_engine=False)
    model = GPTModel(config=cfg, transformer_layer_spec=trace_spec_from_args(
        experts_only, dataclasses.replace(stock_spec(cfg), layer_specs=[])), vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope", mtp_block_spec=mtp)
    assert any(isinstance(m, MoELayer) for m in model.mtp.modules())
    with trace_train_step(experts_only, [model]):
        pass


def test_a_modelopt_model_is_refused_by_name():
    """Megatron-LM builds a ModelOpt model (--modelopt-enabled, or set by get_model for a ModelOpt checkpoint) with
    ModelOpt's builder, never TRACE's spec: the step says so instead of "no TRACE modules"."""
    import argparse

    from megatron_trace.megatron import add_trace_args, trace_train_step

    model = build_model(tiny_config(), stock_spec(tiny_config()))
    args = add_trace_args(argparse.ArgumentParser()).parse_args(["--trace-fp4"])
    args.modelopt_enabled = True
    with pytest.raises(ValueError, match="--trace-fp4 cannot run on a ModelOpt model"), trace_train_step(args, [model]):
        pass
    args.trace_fp4 = False
    with trace_train_step(args, [model]):  # stock Megatron-LM with ModelOpt: untouched
        pass


def test_megatron_lm_step_with_excluded_modules_binds_the_layers_first():
    """--trace-exclude-modules needs the experts' layer ids at the first forward: the step hook binds them."""
    import argparse

    from megatron_trace.megatron import add_trace_args, trace_spec_from_args, trace_train_step

    args = add_trace_args(argparse.ArgumentParser()).parse_args(
        ["--trace-fp4", "--trace-exclude-modules", "model.layers.0.*"])
    cfg = tiny_config()
    model = build_model(cfg, trace_spec_from_args(args, stock_spec(cfg)))
    data = batch()
    with trace_train_step(args, [model]):
        model(*data[:3], labels=data[3]).float().mean().backward()
    experts = [m for m in model.modules() if hasattr(m, "trace_quantizes") and hasattr(m, "_weight_reuse")]
    assert [e.trace_quantizes("weights") for e in experts] == [False, True, True, True]


def test_evaluation_before_any_training_step_with_excluded_modules():
    """Megatron-LM evaluates without a training step before it with ``--skip-train`` (and the patched evaluate then
    runs before ``trace_train_step`` ever bound the experts' layer ids): ``trace_eval_start`` binds them, so
    ``--trace-exclude-modules`` applies there too. Without it, the evaluation's first forward raised ("exclude_modules
    needs the experts' layer ids"). The excluded layer's experts run unquantized, the others quantize."""
    import argparse

    from megatron_trace.megatron import add_trace_args, trace_eval_done, trace_eval_start, trace_spec_from_args

    args = add_trace_args(argparse.ArgumentParser()).parse_args(["--trace-fp4", "--trace-exclude-modules",
                                                                 "model.layers.0.*"])
    cfg = tiny_config()
    model = build_model(cfg, trace_spec_from_args(args, stock_spec(cfg)))
    trace_eval_start(args, [model])
    with torch.no_grad():
        model(*batch()[:3])
    trace_eval_done(args, [model])
    experts = [m for m in model.modules() if hasattr(m, "trace_quantizes") and hasattr(m, "_weight_reuse")]
    assert [e.trace_quantizes("weights") for e in experts] == [False, True, True, True]
    off = add_trace_args(argparse.ArgumentParser()).parse_args([])
    trace_eval_start(off, [build_model(cfg, stock_spec(cfg))])  # TRACE off: a stock model, nothing walked


def test_nan_counted_in_evaluation_is_logged_there_not_taken_for_the_next_steps(caplog):
    """Megatron-LM's evaluate() runs forward-only outside ``trace_train_step``. The Triton quantizers only count NaN/Inf
    there (the reference raises at once; the count is added as a Triton quantize adds it): the patched evaluate's
    ``trace_eval_done`` logs them naming the site and resets them, so the next training step passes. Without it,
    that step raised for them."""
    import argparse

    from megatron_trace.megatron import (
        NonFiniteError,
        add_trace_args,
        find_trace_layers,
        trace_eval_done,
        trace_spec_from_args,
        trace_train_step,
    )

    args = add_trace_args(argparse.ArgumentParser()).parse_args(["--trace-fp4"])
    cfg = tiny_config()
    model = build_model(cfg, trace_spec_from_args(args, stock_spec(cfg)))
    data = batch()
    moe = next(iter(find_trace_layers(model).moe.values()))

    def evaluate():
        with torch.no_grad():
            model(*data[:3])
        moe.experts._finite["expert_fc1_in"].add_bad(torch.tensor([True, True]))

    def train_step():
        with trace_train_step(args, [model]):
            model(*data[:3], labels=data[3]).float().mean().backward()

    evaluate()
    with pytest.raises(NonFiniteError, match="since the last check"):  # the step took them for its own
        train_step()
    evaluate()
    with caplog.at_level(logging.ERROR, logger="megatron_trace.megatron.train_step"):
        trace_eval_done(args, [model])
    label = moe.experts._finite["expert_fc1_in"].label
    assert [r.getMessage() for r in caplog.records] == [
        f"--trace-fp4: FP4 quantization inputs held NaN/Inf in evaluation ({label}: 2 NaN/Inf value(s)); FP4 has no "
        "NaN/Inf: the values were passed through unquantized"]
    train_step()  # reset: the next step passes
    caplog.clear()
    trace_eval_done(args, [model])  # nothing counted: nothing logged
    trace_eval_done(add_trace_args(argparse.ArgumentParser()).parse_args([]), [model])  # TRACE off: nothing read
    assert caplog.records == []


def test_a_train_step_that_raises_leaves_no_nan_count_to_the_next():
    """A Megatron-LM train step that raised (an OOM, an interrupt) after a Triton quantize counted NaN/Inf inputs kept
    the counts: the next, clean step's check then raised ``NonFiniteError`` for them. They are now read and reset as
    the failed step leaves, and named in a note on its error (the count is added as a Triton quantize adds it)."""
    import argparse

    from megatron_trace.megatron import add_trace_args, find_trace_layers, trace_spec_from_args, trace_train_step

    args = add_trace_args(argparse.ArgumentParser()).parse_args(["--trace-fp4", "--trace-reuse-weight-quant"])
    cfg = tiny_config()
    model = build_model(cfg, trace_spec_from_args(args, stock_spec(cfg)))
    data = batch()
    moe = next(iter(find_trace_layers(model).moe.values()))
    with pytest.raises(RuntimeError, match="out of memory") as err, trace_train_step(args, [model]):
        model(*data[:3], labels=data[3]).float().mean().backward()
        moe.experts._finite["expert_fc1_in"].add_bad(torch.tensor([True, True, True]))
        raise RuntimeError("CUDA out of memory")
    label = moe.experts._finite["expert_fc1_in"].label
    assert err.value.__notes__ == [f"--trace-fp4: the failed step's FP4 quantization inputs held NaN/Inf ({label}: 3 "
                                   "NaN/Inf value(s)); read and reset on its way out"]
    assert all(m._weight_reuse is None for m in model.modules() if hasattr(m, "_weight_reuse"))  # scope closed
    with trace_train_step(args, [model]):  # the next step passes
        model(*data[:3], labels=data[3]).float().mean().backward()
