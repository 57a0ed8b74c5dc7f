"""TraceConfig.kernel reaches the fake-quant calls of the TRACE experts and the KV site (kernels.select_kernel).

On CPU "auto" and "reference" run the formats reference (bit-identical logits); "triton" must refuse CPU tensors
with select_kernel's error, which proves the modules route their quantization through the selection.
(tests/gpu/test_megatron_gpu.py checks Triton == reference bit for bit on CUDA.)
"""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import trace_guidance, trace_spec

from .harness import batch, build_model, logits, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")


def _model(**tc_kw):
    cfg = tiny_config()
    return build_model(cfg, trace_spec(stock_spec(cfg), TraceConfig(**tc_kw)))


def test_auto_and_reference_give_identical_logits_on_cpu():
    data = batch()
    assert torch.equal(logits(_model(kernel="auto"), data), logits(_model(kernel="reference"), data))


@pytest.mark.parametrize("sites", [("weights",), ("expert_fc1_in",), ("expert_fc2_in",), ("kv_k",)])
def test_triton_is_selected_at_every_site(sites):
    model = _model(kernel="triton", sites=sites, guided_sites=())
    with pytest.raises(ValueError, match="kernel='triton' cannot run: tensors are on cpu"):
        logits(model, batch())


def test_guided_rows_go_through_the_selection_too():
    """With guidance the same kernel choice is made (recording itself stays on the reference)."""
    data = batch()
    ref = _model(kernel="reference", guided_layers="all")
    tokens, pos, mask, _ = data
    with trace_guidance(ref, record=True) as h, torch.no_grad():
        ref(tokens, pos, mask)
    step = h.recorded()
    model = _model(kernel="triton", sites=("kv_k",), guided_sites=("kv_k",), guided_layers="all")
    step.sites = {k: v for k, v in step.sites.items() if k[1] == "kv_k"}
    with pytest.raises(ValueError, match="kernel='triton' cannot run"):
        with trace_guidance(model, step), torch.no_grad():
            model(tokens, pos, mask)
