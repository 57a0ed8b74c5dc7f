"""Host time per call of the trainer's fake-quant entry points (what a host-bound stretch of a step pays per call).

After a host sync the GPU waits for the host's next launch, so a call's host time (Python, allocations, the
Triton launcher) adds to the step there. Each op runs on small tensors (the GPU is never the bottleneck) many times
without a sync; the host microseconds per call are the wall time over the calls. ``--cprofile OP`` adds the
functions with the most own time for that op. Prints one JSON line:
    python benchmarks/bench_host_overhead.py [--calls 2000] [--cprofile fake_quant_weights]
On CPU (``--smoke``, Triton's interpreter: ``TRITON_INTERPRET=1``) only that the ops run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import host_us, profile_op  # noqa: E402

from megatron_trace.formats import Quantizer  # noqa: E402
from megatron_trace.kernels import fused, ops  # noqa: E402
from megatron_trace.kernels.checks import FiniteCounter  # noqa: E402
from megatron_trace.megatron import expert_weights  # noqa: E402


class _Expert(torch.nn.Module):
    """One expert's registry layout as in Megatron's SequentialMLP (``linear_fc1.weight``), tiny."""

    def __init__(self, device):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(16, 32, bias=False, device=device)


def cases(device: str, k: int) -> dict:
    """op name -> a no-argument call, on small bf16 tensors of row length k."""
    q_row = Quantizer("nvfp4", per_row=True)
    q_w = Quantizer("nvfp4")
    x = torch.randn(64, k, device=device).to(torch.bfloat16)
    w = torch.randn(8, 64, k, device=device).to(torch.bfloat16)
    counter = FiniteCounter("bench")
    rec = fused.quantize(x, q_row, record=True, check_finite=False)[1]
    experts = torch.nn.ModuleList(_Expert(device) for _ in range(128))  # the local experts of a 30B-A3B layer
    expert_weights.pack(expert_weights.of(experts, "linear_fc1"))

    def weights_given():  # session 20's ``quantize_weights``: per-expert amax by torch ops, a given per-row amax
        amax = ops.abs_max(w, start_dim=1)[..., None, None]
        amax = torch.where(amax > 0, amax, 1.0).expand(*w.shape[:-1], 1)
        return fused.fake_quantize(w, q_w, global_amax=amax, check_finite=counter)

    return {
        "torch_add (reference point)": lambda: x.add(1),
        "fake_quant_rows": lambda: fused.fake_quantize(x, q_row, check_finite=counter),
        "fake_quant_rows_unchecked": lambda: fused.fake_quantize(x, q_row, check_finite=False),
        "fake_quant_weights": lambda: fused.fake_quantize(w, q_w, stacked=True, check_finite=counter),
        "fake_quant_weights_given_amax": weights_given,
        "guided_fake_quant_rows": lambda: fused.fake_quantize(x, q_row, guidance=rec, check_finite=counter),
        "abs_max": lambda: ops.abs_max(w, start_dim=1),
        "expert_weights_getattr (128; session 21)": lambda: [e.linear_fc1.weight for e in experts],
        "expert_weights.of (128)": lambda: expert_weights.of(experts, "linear_fc1"),
        "expert_weights.stacked (128; with gradient)": lambda: expert_weights.stacked(
            expert_weights.of(experts, "linear_fc1")),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--cprofile", default="", help="comma-separated ops to cProfile (by own time)")
    p.add_argument("--smoke", action="store_true", help="CPU (Triton's interpreter), a few calls")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.smoke:
        raise SystemExit("no CUDA: run with --smoke (and TRITON_INTERPRET=1) on CPU")
    calls = 3 if a.smoke else a.calls
    ops_ = cases(device, 64 if a.smoke else a.k)
    named = [n for n in a.cprofile.split(",") if n]
    unknown = [n for n in named if n not in ops_]
    if unknown:  # (before: a KeyError after every op had been timed)
        p.error(f"--cprofile {a.cprofile!r}: {unknown} not among the ops: {', '.join(ops_)}")
    res = {"bench": "host_overhead", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "calls": calls, "host_us_per_call": {}, "cprofile": {}}
    for name, fn in ops_.items():
        res["host_us_per_call"][name] = round(host_us(fn, calls, device, 1 if a.smoke else 20), 2)
        print(f"{name:32s} {res['host_us_per_call'][name]:8.1f} us/call", file=sys.stderr)
    for name in named:
        res["cprofile"][name] = profile_op(ops_[name], calls)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
