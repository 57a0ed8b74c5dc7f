"""Kernel selection (CPU): the reference is chosen wherever Triton cannot run, and 'triton' says why."""

import pytest
import torch

from megatron_trace import kernels
from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer
from megatron_trace.kernels import Kernel, abs_max, select_kernel


def test_kernel_names_match_config_choices():
    assert set(kernels.KERNELS) == {"auto", "reference", "triton"}
    assert TraceConfig(kernel="triton").kernel in kernels.KERNELS


@pytest.mark.parametrize("name", ["auto", "reference", Kernel.AUTO])
def test_cpu_tensors_use_the_reference(name):
    assert select_kernel(name, "cpu") is Kernel.REFERENCE


def test_triton_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="need CUDA"):
        select_kernel("triton", torch.device("cpu"))


def test_unknown_kernel_name_is_rejected():
    with pytest.raises(ValueError, match="kernel='cuda' is not one of"):
        select_kernel("cuda", "cpu")


def test_auto_falls_back_when_unsupported(monkeypatch):
    monkeypatch.setattr(kernels.dispatch, "triton_available", lambda: True)
    assert select_kernel("auto", "cuda") is Kernel.TRITON
    assert select_kernel("auto", "cuda", unsupported="stochastic rounding") is Kernel.REFERENCE
    with pytest.raises(ValueError, match="stochastic rounding"):
        select_kernel("triton", "cuda", unsupported="stochastic rounding")
    monkeypatch.setattr(kernels.dispatch, "triton_available", lambda: False)
    assert select_kernel("auto", "cuda") is Kernel.REFERENCE
    with pytest.raises(RuntimeError, match="not installed"):
        select_kernel("triton", "cuda")


def test_ops_on_cpu_equal_the_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    q = Quantizer("nvfp4", per_row=True)
    ref = q.quantize(x)
    t = kernels.quantize(x, q)
    assert torch.equal(t.codes, ref.codes)
    assert torch.equal(t.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8))
    t2, rec = kernels.quantize_and_record(x, q)
    assert torch.equal(rec.mantissa_bits, ref.guidance(compact=True).mantissa_bits)
    assert torch.equal(kernels.compact_guidance(ref.guidance(compact=False)).mantissa_bits, rec.mantissa_bits)
    assert torch.equal(kernels.guided_quantize(x, rec).codes, ref.codes)
    assert torch.equal(kernels.dequantize(t, torch.bfloat16), ref.dequantize(torch.bfloat16))
    assert torch.equal(kernels.fake_quantize(x, q), q.fake_quantize(x))


def test_stochastic_rounding_runs_on_the_reference_under_auto():
    q = Quantizer("nvfp4", rounding="stochastic")
    x = torch.randn(2, 32)
    assert kernels.quantize(x, q).codes.shape == (2, 16)
    with pytest.raises(ValueError, match="kernel='triton' cannot run"):
        kernels.quantize(x, q, kernel="triton")


def test_abs_max_equals_the_reference_reduction():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(5, 7, 48, generator=g) * 3).to(dtype)
        w[2] = -w[2].abs()  # an expert whose amax is a negative value's magnitude
        w[3] = 0.0
        w[4, 0, 0] = -0.0
        assert torch.equal(abs_max(w, start_dim=1), w.float().abs().amax(dim=(-2, -1)))
        assert torch.equal(abs_max(w), w.float().abs().amax())
    w[1, 2, 3] = float("nan")
    assert abs_max(w, start_dim=1).isnan().tolist() == [False, True, False, False, False]


def test_host_cdiv_and_next_pow2_equal_tritons():
    """The host code's plain-Python twins of Triton 3.6's constexpr functions (which cost ~10 us per call)."""
    triton = pytest.importorskip("triton")
    from megatron_trace.kernels.dispatch import cdiv, next_pow2

    for n in [*range(0, 70), 127, 128, 129, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
