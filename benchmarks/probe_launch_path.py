"""Host time of one ``pair_kernel`` launch by three paths (what a launch cache in front of Triton's JIT would save).

``fused.fake_quantize`` of a small bf16 x is run once with a pre-run hook that keeps the kernel's arguments; then,
without syncs, microseconds per launch of: Triton's ``JITFunction`` path (``kernel[grid](*args, **kwargs)``: binds
and specializes the arguments, builds the cache key, checks the globals), the compiled kernel called directly
(``compiled[grid](*ordered_args)``), and the same with a Python key of what Triton specializes on (dtype and
16-byte alignment per tensor, 1 / divisibility by 16 / width per int, the constexprs) looked up in a dict.
Prints one JSON line:
    python benchmarks/probe_launch_path.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_trace.formats import Quantizer  # noqa: E402
from megatron_trace.kernels import fused  # noqa: E402
from megatron_trace.kernels.quant_pair_triton import pair_kernel  # noqa: E402


def _tag(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool) or a is None or isinstance(a, float):
        return a
    if isinstance(a, int):
        return a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63
    return a


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return round(t / calls * 1e6, 2)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=5000)
    a = p.parse_args(argv)
    x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    q = Quantizer("nvfp4", per_row=True)
    seen = {}
    pair_kernel.add_pre_run_hook(lambda *args, **kw: seen.update(args=args, kwargs=kw))
    fused.fake_quantize(x, q, check_finite=False)
    pair_kernel.pre_run_hooks.clear()
    args, kwargs = seen["args"], {k: v for k, v in seen["kwargs"].items() if k not in ("debug", "instrumentation_mode")}
    names = [prm.name for prm in pair_kernel.params]
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = inspect.signature(pair_kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    ordered = list(bound.arguments.values())
    compiled = pair_kernel[(1,)](*args, **kwargs)
    grid = (1, 1, 1)
    cache = {}

    def keyed():
        key = (tuple(_tag(v) for v in ordered), tuple(options.items()))
        k = cache.get(key)
        if k is None:
            k = cache[key] = compiled
        k[grid](*ordered)

    res = {"bench": "probe_launch_path", "device": torch.cuda.get_device_name(), "args": len(ordered),
           "constexprs": sum(prm.is_constexpr for prm in pair_kernel.params), "us_per_launch": {
               "torch_add (reference point)": per_call_us(lambda: x.add(1), a.calls),
               "jit_path": per_call_us(lambda: pair_kernel[(1,)](*args, **kwargs), a.calls),
               "compiled_direct": per_call_us(lambda: compiled[grid](*ordered), a.calls),
               "compiled_with_python_key": per_call_us(keyed, a.calls),
               "key_only": per_call_us(lambda: (tuple(_tag(v) for v in ordered), tuple(options.items())), a.calls),
               "fused.fake_quantize (whole op)": per_call_us(lambda: fused.fake_quantize(x, q, check_finite=False),
                                                             a.calls)}}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
