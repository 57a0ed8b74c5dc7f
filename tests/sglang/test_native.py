"""Blackwell path selection (device capability mocked at the one device query) and the scale un-swizzle.

The native kernels themselves cannot run here (no Blackwell GPU, no sgl_kernel): see rollout/sglang/native.py."""

import ast
import importlib.util
import os
import types

import pytest
import torch

from megatron_trace.formats import nvfp4
from megatron_trace.rollout.sglang import native

from ._common import CFG, needs_sglang

pytestmark = needs_sglang


@pytest.fixture(scope="module")
def quant():
    from megatron_trace.rollout.sglang.launch import register

    register(CFG)
    from megatron_trace.rollout.sglang import quant

    return quant


@pytest.mark.parametrize("cap, want", [((10, 0), True), ((12, 0), True), ((9, 0), False), ((8, 9), False),
                                       (None, False)])
def test_native_path_selected_by_capability(quant, monkeypatch, cap, want):
    monkeypatch.setattr(native, "device_capability", lambda: cap)
    cfg = quant.TraceQuantConfig(CFG)
    assert cfg.native is want and native.native_fp4_available() is want
    linear = quant.TraceNvFp4LinearMethod(cfg)
    assert (linear.native is not None) is want


def test_native_moe_method_delegates_to_sglangs_modelopt_method(quant, monkeypatch):
    """With capability 10 reported, the MoE method builds SGLang's ModelOptNvFp4FusedMoEMethod, whose own
    platform check (a real device query inside SGLang) then refuses this CPU machine."""
    monkeypatch.setattr(native, "device_capability", lambda: (10, 0))
    with pytest.raises(ValueError, match="Blackwell"):
        quant.TraceModelOptNvFp4MoEMethod(quant.TraceQuantConfig(CFG))
    monkeypatch.setattr(native, "device_capability", lambda: (9, 0))
    assert quant.TraceModelOptNvFp4MoEMethod(quant.TraceQuantConfig(CFG)).native is False
    # the fc1 record is a no-op without a capture or without a usable static input amax (no host sync)
    native.record_fc1_input(None, types.SimpleNamespace(layer_id=0), torch.zeros(2, 32))


def test_experts_exclusion_by_prefix(quant):
    cfg = CFG.replace(exclude_modules=("model.layers.0.mlp.experts",))
    assert quant.experts_layer("model.layers.12.mlp.experts") == 12
    assert quant.experts_layer("model.layers.12.mlp.shared_expert") is None
    assert quant.trace_excludes(cfg, "model.layers.0.mlp.experts")
    assert not quant.trace_excludes(cfg, "model.layers.1.mlp.experts")
    assert not quant.trace_excludes(CFG, "model.layers.0.mlp.experts")


def _sglang_swizzle():
    """SGLang's ``quantization.utils.swizzle_blockscale`` from its source, its trailing ``.cuda()`` removed
    (test-only: the function moves the result to CUDA, which does not exist here)."""
    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    tree = ast.parse(open(os.path.join(root, "srt", "layers", "quantization", "utils.py")).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "swizzle_blockscale")
    src = ast.unparse(fn).replace(".contiguous().cuda()", ".contiguous()")
    ns = {"torch": torch}
    exec(compile(src, "swizzle_blockscale", "exec"), ns)  # noqa: S102
    return ns["swizzle_blockscale"]


@pytest.mark.parametrize("m, k", [(5, 64), (130, 48), (256, 256)])
def test_unswizzle_inverts_sglangs_swizzle(m, k):
    q = nvfp4.quantize(torch.randn(m, k), global_amax=torch.tensor(7.0))
    swizzled = _sglang_swizzle()(q.block_scales)
    assert torch.equal(native.swizzle_scales(q.block_scales).view(torch.uint8), swizzled.view(torch.uint8))
    back = native.unswizzle_scales(swizzled, m, k // 16)
    assert torch.equal(back.view(torch.uint8), q.block_scales.view(torch.uint8))
    rec = native.fp4_from_op(q.codes, swizzled, torch.tensor(7.0), k)
    assert torch.equal(rec.dequantize(), q.dequantize()) and rec.global_amax.dim() == 0


def test_static_input_amax():
    gs = torch.full((4,), 448.0 * 6 / 3.0)
    assert float(native.static_input_amax(types.SimpleNamespace(w13_input_scale_quant=gs))) == pytest.approx(3.0)
    gs[2] = 1.0
    assert native.static_input_amax(types.SimpleNamespace(w13_input_scale_quant=gs)) is None
    layer = types.SimpleNamespace(w13_input_scale_quant=gs, layer_id=3)
    native.prepare_layer(layer)
    assert getattr(layer, native.AMAX_ATTR) is None
