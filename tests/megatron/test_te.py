"""The thin Transformer-Engine variant: a clear error without TE, and its weight-fetch hook (TE-independent)."""

import importlib.util

import pytest
import torch
from megatron.core.transformer.mlp import MLPSubmodules

from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer
from megatron_trace.megatron import TE_EXTRA_HINT, TraceTEGroupedMLP, TraceWeightFetch, get_trace_gpt_layer_spec
from megatron_trace.megatron.te import trace_te_attention_class, with_weight_fetch

from .harness import tiny_config

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed")
def test_without_te_construction_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'megatron_trace\[te\]'"):
        TraceTEGroupedMLP(8, tiny_config(), MLPSubmodules(), trace_config=TraceConfig())
    with pytest.raises(ImportError, match=r"megatron_trace\[te\]"):
        trace_te_attention_class()
    with pytest.raises(ImportError, match=r"megatron_trace\[te\]"):
        get_trace_gpt_layer_spec(TraceConfig(), num_experts=8, use_te=True)
    assert "megatron_trace[te]" in TE_EXTRA_HINT


class _GroupedLinear(torch.nn.Module):
    """Stands in for TE's GroupedLinear: weights weight{i}, fetched with ``_get_weight_tensors``."""

    def __init__(self, n=3, out=32, inp=48):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out, inp)))
        self.n = n

    def _get_weight_tensors(self):
        return [getattr(self, f"weight{i}") for i in range(self.n)]

    def forward(self, x, m_splits):
        ws = self._get_weight_tensors()
        return torch.cat([xe @ w.t() for xe, w in zip(torch.split(x, m_splits), ws)])


def test_weight_fetch_hook_fake_quantizes_with_straight_through_grads():
    torch.manual_seed(0)
    cls = with_weight_fetch(_GroupedLinear)
    assert with_weight_fetch(_GroupedLinear) is cls and issubclass(cls, TraceWeightFetch)
    layer = cls()
    layer.trace_weight_quantizer = Quantizer("nvfp4")
    fetched = layer._get_weight_tensors()
    for i, w in enumerate(fetched):
        assert torch.equal(w, Quantizer("nvfp4").quantize(getattr(layer, f"weight{i}")).dequantize(w.dtype))
    x = torch.randn(10, 48)
    layer(x, [4, 0, 6]).sum().backward()
    ref = [w.detach().requires_grad_() for w in fetched]
    torch.cat([xe @ w.t() for xe, w in zip(torch.split(x, [4, 0, 6]), ref)]).sum().backward()
    for i in range(3):
        assert torch.equal(getattr(layer, f"weight{i}").grad, ref[i].grad)


def test_weight_fetch_hook_is_a_no_op_without_a_quantizer():
    layer = with_weight_fetch(_GroupedLinear)()
    assert all(a is b for a, b in zip(layer._get_weight_tensors(), _GroupedLinear._get_weight_tensors(layer)))


class _OldGroupedLinear(torch.nn.Module):
    """TE < 2.5's GroupedLinear: its forward reads ``weight{i}`` directly (no ``_get_weight_tensors``)."""

    def __init__(self):
        super().__init__()
        self.weight0 = torch.nn.Parameter(torch.randn(32, 48))

    def forward(self, x, m_splits):
        return x @ self.weight0.t()


def test_weight_fetch_refuses_a_te_that_bypasses_it():
    """With TE < 2.5 the hook would never run and the experts would train on BF16 weights: refuse at build time."""
    with pytest.raises(ImportError, match=r"_OldGroupedLinear has no _get_weight_tensors.*transformer-engine>=2\.5"):
        with_weight_fetch(_OldGroupedLinear)
