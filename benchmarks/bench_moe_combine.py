"""The experts combine: PyTorch's gather, multiply and sum (``fp4_moe._combine_torch``) against the one-launch
Triton kernel (``kernels.moe_combine_triton``), and which fp32 sum order reproduces PyTorch's bits.

For each token count T (k = 8 slots, hidden H): device us of both (CUDA graph of 10 calls, L2 flushed before each;
``_timing.graph_ms``), the bytes the kernel must move (k rows of H read per token, one written) as a fraction of
the copy bandwidth, and for each of the kernel's orders the elements whose bits differ from PyTorch's on expert
outputs scaled by 2**[-12, 12] per row (so that the fp32 sum is often inexact). One JSON line per T.
Usage (H200, carry .whl): python3 benchmarks/bench_moe_combine.py [--tokens 1,8,64,512,4096,16384] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from megatron_trace.kernels import moe_combine_triton as mc
from megatron_trace.rollout import fp4_moe


def inputs(tokens: int, k: int, h: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.exp2(torch.randint(-12, 13, (tokens * k, 1), generator=g, device="cuda").float())
    y = (torch.randn(tokens * k, h, generator=g, device="cuda") * scale).to(torch.bfloat16)
    inv = torch.randperm(tokens * k, generator=g, device="cuda")
    w = torch.softmax(torch.randn(tokens, k, generator=g, device="cuda"), -1)
    return y, inv, w


def one(tokens: int, k: int, h: int, bw: float) -> dict:
    from _timing import graph_ms

    y, inv, w = inputs(tokens, k, h, seed=tokens)
    torch_out = fp4_moe._combine_torch(y, inv, w, torch.bfloat16)
    differ = {o: int((mc.combine(y, inv, w, torch.bfloat16, o).view(torch.int16) != torch_out.view(torch.int16))
                     .sum()) for o in mc.ORDERS}
    eager = graph_ms(lambda: fp4_moe._combine_torch(y, inv, w, torch.bfloat16)) * 1e3
    kernel = graph_ms(lambda: mc.combine(y, inv, w, torch.bfloat16)) * 1e3
    nbytes = (k + 1) * tokens * h * 2
    return {"bench": "moe_combine", "tokens": tokens, "k": k, "hidden": h, "eager_us": round(eager, 1),
            "kernel_us": round(kernel, 1), "speedup": round(eager / kernel, 2),
            "kernel_frac_copy": round(nbytes / (kernel * 1e-6) / bw, 3), "elements": tokens * h,
            "bits_differ_from_torch": differ}


def main(argv=None):
    from _timing import copy_bandwidth

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,512,4096,16384")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k", type=int, default=8)
    args = p.parse_args(argv)
    bw = copy_bandwidth(1 << 29)
    for t in (int(x) for x in args.tokens.split(",")):
        print(json.dumps(one(t, args.k, args.hidden, bw)), flush=True)


if __name__ == "__main__":
    main()
