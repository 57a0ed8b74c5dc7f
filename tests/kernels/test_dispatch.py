"""Kernel selection (CPU): the reference is chosen wherever Triton cannot run, and 'triton' says why."""

import pytest
import torch

from megatron_trace import kernels
from megatron_trace.config import TraceConfig
from megatron_trace.formats import Quantizer, nvfp4
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


@pytest.mark.parametrize("shape,start_dim", [((0, 16), 0), ((3, 0, 16), 1), ((0, 4, 16), 1)])
def test_abs_max_of_no_element_is_zero_as_the_reference(shape, start_dim):
    """(was: aminmax's "Expected reduction dim 0 to have non-zero size", where NVFP4's own per-tensor amax of an
    empty tensor, an EP rank without tokens, is 0)"""
    x = torch.zeros(shape)
    got = abs_max(x, start_dim=start_dim)
    assert got.dtype == torch.float32 and got.shape == shape[:start_dim] and not got.any()
    assert torch.equal(abs_max(x, start_dim=start_dim - len(shape)), got)  # (a negative start_dim counts back)
    if start_dim == 0:
        assert torch.equal(got, nvfp4.FORMAT.global_amax(x))


@pytest.mark.parametrize("x,start_dim,err,match", [
    (torch.tensor([-128, 1], dtype=torch.int8), 0, TypeError, "abs_max needs a floating-point tensor, got torch.int8"),
    (torch.ones(2, dtype=torch.bool), 0, TypeError, "got torch.bool"),
    ([1.0, -2.0], 0, TypeError, "got list"),
    (torch.ones(4, 32), 3, ValueError, r"start_dim=3 must be an int in -2..2 \(x has shape \(4, 32\)\)"),
    (torch.ones(4, 32), -3, ValueError, "start_dim=-3 must be an int in -2..2"),
], ids=["int8", "bool", "list", "past-the-dims", "negative"])
def test_abs_max_names_what_it_cannot_reduce(x, start_dim, err, match):
    """(were: int8 [-128, 1] gave 1.0, its negation overflowing; start_dim=3 of a 2-D x gave |x| per element)"""
    with pytest.raises(err, match=match):
        abs_max(x, start_dim=start_dim)


def test_host_cdiv_and_next_pow2_equal_tritons():
    """The host code's plain-Python twins of Triton 3.6's constexpr functions (which cost ~10 us per call)."""
    triton = pytest.importorskip("triton")
    from megatron_trace.kernels.dispatch import cdiv, next_pow2

    for n in [*range(0, 70), 127, 128, 129, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_guided_quantize_runs_a_record_only_format_on_its_reference():
    """An ``sglang_kvfp4`` record: "auto" runs its reference (on the CPU it raised "fmt='sglang_kvfp4' is not one
    of ('nvfp4', 'mxfp4')", on CUDA the Triton kernel took it for MXFP4 blocks of 16), "triton" says why not."""
    from megatron_trace.formats import sglang_kvfp4

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    record = sglang_kvfp4.quantize(x * 1.05, compute_dtype=torch.float32).guidance(compact=True)
    want = sglang_kvfp4.guided_quantize(x, record)
    got = kernels.guided_quantize(x, record)
    assert torch.equal(got.codes, want.codes) and got.fmt == "sglang_kvfp4"
    assert torch.equal(got.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    with pytest.raises(ValueError, match="kernel='triton' cannot run"):
        kernels.guided_quantize(x, record, kernel="triton")


def test_guided_quantize_reasons_for_a_record_only_format(monkeypatch):
    from megatron_trace.kernels import ops

    reasons = []
    monkeypatch.setattr(ops, "select_kernel", lambda k, d, unsupported=None: reasons.append(unsupported) or
                        Kernel.REFERENCE)
    x = torch.randn(2, 32)
    for fmt in ("nvfp4", "mxfp4"):
        kernels.guided_quantize(x, Quantizer(fmt).quantize(x).guidance(compact=True))
    assert reasons == [None, None]
    from megatron_trace.formats import sglang_kvfp4

    kernels.guided_quantize(x, sglang_kvfp4.quantize(x).guidance(compact=False))
    assert reasons[-1] == "fmt='sglang_kvfp4' records have no Triton path (the reference runs them)"


def test_fake_quantize_names_why_a_record_only_format_has_no_triton_path(monkeypatch):
    """SGLang's KV quantizer (rounding "ties_away"): the reason was "stochastic rounding" without guidance, and with
    guidance none (the Triton kernel, which takes NVFP4 and MXFP4 only, was chosen on CUDA)."""
    from megatron_trace.formats import sglang_kvfp4
    from megatron_trace.kernels import ops

    reasons = []
    monkeypatch.setattr(ops, "select_kernel", lambda k, d, unsupported=None: reasons.append(unsupported) or
                        Kernel.REFERENCE)
    q = sglang_kvfp4.SGLangKVQuantizer()
    x = torch.randn(2, 32)
    record = q.quantize(x).guidance(compact=True)
    for guidance in (None, record):
        assert torch.equal(kernels.fake_quantize(x, q, guidance=guidance), q.fake_quantize(x, guidance=guidance))
    assert reasons == ["fmt='sglang_kvfp4' has no Triton path (the reference runs it)"] * 2


@pytest.mark.parametrize("cap", [(8, 0), (8, 9)], ids=["sm80", "sm89"])
def test_a_gpu_older_than_hopper_uses_the_reference(cap, monkeypatch):
    """The kernels' PTX does not assemble for sm_80 / sm_89 (ptxas: "Feature 'min.u16x2' requires .target sm_90 or
    higher"): "auto" picked Triton there and the launch failed to compile; now it runs the reference, "triton" says
    why."""
    monkeypatch.setattr(kernels.dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(kernels.dispatch, "cuda_capability", lambda device: cap)
    assert select_kernel("auto", "cuda") is Kernel.REFERENCE
    with pytest.raises(ValueError, match=rf"compute capability {cap[0]}\.{cap[1]}, the Triton kernels need 9\.0"):
        select_kernel("triton", "cuda:1")
    monkeypatch.setattr(kernels.dispatch, "cuda_capability", lambda device: (9, 0))
    assert select_kernel("auto", "cuda") is Kernel.TRITON
    monkeypatch.setattr(kernels.dispatch, "cuda_capability", lambda device: (10, 0))
    assert select_kernel("auto", "cuda") is Kernel.TRITON


@pytest.mark.parametrize("name", ["Triton", "REFERENCE", "", None])
def test_kernel_names_are_exact(name):
    with pytest.raises(ValueError, match=r"is not one of \('auto', 'reference', 'triton'\)"):
        select_kernel(name, "cpu")


def test_reference_is_kept_where_triton_could_run(monkeypatch):
    """On a Hopper GPU with Triton, "auto" picks Triton and "reference" still runs the reference."""
    monkeypatch.setattr(kernels.dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(kernels.dispatch, "cuda_capability", lambda device: (9, 0))
    assert select_kernel("auto", "cuda:0") is Kernel.TRITON
    for name in ("reference", Kernel.REFERENCE):
        assert select_kernel(name, "cuda:0") is Kernel.REFERENCE


@pytest.mark.parametrize("device", ["meta", "mps", "xpu"])
def test_devices_other_than_cuda_use_the_reference(device, monkeypatch):
    """Not only the CPU: any non-CUDA device runs the reference under "auto"; "triton" names it."""
    monkeypatch.setattr(kernels.dispatch, "triton_available", lambda: True)
    assert select_kernel("auto", device) is Kernel.REFERENCE
    with pytest.raises(ValueError, match=f"tensors are on {device}, the Triton kernels need CUDA"):
        select_kernel("triton", device)


def test_ops_name_an_argument_of_the_wrong_type():
    x = torch.randn(2, 32)
    for op in (kernels.quantize, kernels.quantize_and_record):
        with pytest.raises(TypeError, match="quantizer must be a formats.Quantizer, got str"):
            op(x, "nvfp4", kernel="reference")
    record = Quantizer("nvfp4").quantize(x).guidance(compact=True)
    with pytest.raises(TypeError, match="record must be an FP4Tensor or FullGuidance, got CompactGuidance"):
        kernels.compact_guidance(record, kernel="reference")
    # (were: a bare AttributeError, 'str' / 'list' object has no attribute 'rounding' / 'device')
    with pytest.raises(TypeError, match=r"quantizer must be a formats.Quantizer or formats.sglang_kvfp4.SGLangKVQuant"
                                        r"izer, got str"):
        kernels.fake_quantize(x, "nvfp4", kernel="reference")
    for op in (kernels.quantize, kernels.fake_quantize):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
            op(x.tolist(), Quantizer("nvfp4"), kernel="reference")
