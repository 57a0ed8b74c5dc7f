"""NaN/Inf in the rollout's FP4 quantize inputs (``rollout.finite``) on the CPU: the reference quantizer raises in the
call, named by layer and site; the device counters of the Triton path are read once at the end of ``generate``
(their Triton side: ``tests/kernels/test_rollout_finite.py``); weights are refused by name where they are quantized.
"""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.formats import NonFiniteError
from megatron_trace.rollout import HFRolloutBackend, SamplingParams

from ._inject import SITES, VALUES, inject
from ._tiny import tiny_model

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [40]]
CONFIG = TraceConfig(guided_layers="all", cache_mode="full")
SAMPLING = SamplingParams(max_new_tokens=2, seed=0)


def backend(config=CONFIG, model=None):
    return HFRolloutBackend(tiny_model() if model is None else model, mode="fp4", trace_config=config,
                            dtype=torch.float32)


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("site", SITES)
def test_a_nonfinite_input_is_named_by_layer_and_site(site, value):
    be = backend()
    be.generate(PROMPTS, SAMPLING)  # healthy first
    inject(be.model, 1, site, VALUES[value])
    with pytest.raises(NonFiniteError, match=rf"at layer 1 {site}: x holds \d+ NaN/Inf"):
        be.generate(PROMPTS, SAMPLING)


def test_sglang_kv_format_names_the_site_too():
    be = backend(TraceConfig(guided_layers="all", kv_format="sglang_kvfp4"))
    inject(be.model, 2, "kv_v", float("nan"))
    with pytest.raises(NonFiniteError, match="at layer 2 kv_v"):
        be.generate(PROMPTS, SAMPLING)


def test_generate_reads_the_device_counters_once_and_names_them():
    """What a Triton quantize counted (here added by hand, as a kernel adds into ``tensor()``) fails the next
    ``generate`` by name, with nothing returned; the read resets the counters."""
    be = backend()
    be.finite_checks.counter(2, "expert_fc2_in").tensor("cpu").add_(3)
    be.finite_checks.counter(0, "kv_v").tensor("cpu").add_(1)
    be.finite_checks.counter(1, "kv_k").tensor("cpu")  # used, zero: not named
    with pytest.raises(NonFiniteError, match=r"forward order: layer 0 kv_v: 1; layer 2 expert_fc2_in: 3\); nothing "):
        be.generate(PROMPTS, SAMPLING)
    out = be.generate(PROMPTS, SAMPLING)  # reset by the read
    assert out.guidance and be.check_finite() is None


def test_check_finite_reports_a_forward_context_run():
    be = backend()
    be.finite_checks.counter(1, "expert_fc1_in").tensor("cpu").add_(2)
    with pytest.raises(NonFiniteError, match="since the last check.*layer 1 expert_fc1_in: 2"):
        be.check_finite()
    be.check_finite()


def test_checks_order_labels_and_extra_values():
    from megatron_trace.rollout.finite import RolloutFiniteChecks

    checks = RolloutFiniteChecks()
    c = checks.counter(3, "kv_k")
    assert c is checks.counter(3, "kv_k") and c.label == "layer 3 kv_k" and not c.marks
    assert checks.read(torch.tensor(True), torch.tensor([7])) == [1, 7]  # no counter used yet
    for layer, site in [(3, "expert_fc1_in"), (3, "kv_k"), (1, "expert_fc2_in"), (3, "kv_v")]:
        checks.counter(layer, site).tensor("cpu").add_(layer)
    want = "layer 1 expert_fc2_in: 1; layer 3 kv_k: 3; layer 3 kv_v: 3; layer 3 expert_fc1_in: 3"
    with pytest.raises(NonFiniteError, match=want):
        checks.read(torch.tensor(False))
    assert checks.read(torch.tensor(False)) == [0]


def test_a_nonfinite_expert_weight_is_named_at_construction():
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[2].mlp.experts.down_proj[5, 1, 7] = float("inf")
    with pytest.raises(NonFiniteError, match="FP4 weight for layer 2 expert 5 fc2: x holds 1 NaN/Inf"):
        backend(model=model)



def test_a_generate_that_fails_before_its_read_leaves_no_counts_to_the_next_one():
    """A generate that raised mid-way (here the reference quantize of layer 1's K, in the call, after a device
    counter of layer 0 counted: added by hand below, as a Triton kernel adds into ``tensor()``) reads and resets the
    counts on its way out, named on its error: the next, healthy generate returns (it used to fail on the stale
    layer-0 count, blaming a NaN of the failed batch on the new one)."""
    be = backend()
    layers = be.model.model.layers

    def counted(module, args):  # layer 0's fc2 quantize on the Triton path: counts a NaN on the device
        be.finite_checks.counter(0, "expert_fc2_in").tensor("cpu").add_(1)

    def bad_k(module, args, out):
        out = out.clone()
        out.view(-1)[3] = float("nan")
        return out

    hooks = [layers[0].mlp.experts.register_forward_pre_hook(counted),
             layers[1].self_attn.k_norm.register_forward_hook(bad_k)]
    with pytest.raises(NonFiniteError, match="at layer 1 kv_k") as err:
        be.generate(PROMPTS, SAMPLING)
    assert any("layer 0 expert_fc2_in: 1" in note for note in getattr(err.value, "__notes__", []))
    for h in hooks:  # the producer fixed
        h.remove()
    out = be.generate(PROMPTS, SAMPLING)
    assert out.guidance and be.check_finite() is None


def test_sites_are_ordered_by_layer_number_and_an_unnamed_reference_error_stays_as_it_is():
    """Layer 10 after layer 2 (numbers, not strings); with no counter (``naming(None)``: an unchecked call) the
    reference quantizer's ``NonFiniteError`` is raised as it is, naming no site."""
    from megatron_trace.rollout.finite import RolloutFiniteChecks, naming

    checks = RolloutFiniteChecks()
    for layer in (10, 2):
        checks.counter(layer, "kv_k").tensor("cpu").add_(1)
    with pytest.raises(NonFiniteError, match="layer 2 kv_k: 1; layer 10 kv_k: 1"):
        checks.read()
    x = torch.ones(2, 16)
    x[1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^x holds 1 NaN/Inf") as e:
        with naming(None):
            CONFIG.activation_quantizer().quantize(x)
    assert "rollout FP4 quantize input" not in str(e.value)
