"""The rollout's routed-experts forward at prefill sizes (``fp4_moe.grouped_experts_forward``: FP4 activation
quantization, routing, both grouped GEMMs, gate, combine) with the Triton GEMM against the wgmma GEMM
(``experts.PREFILL_WGMMA``'s path: the store's "wgmma" copy), and bf16 weights (``torch._grouped_mm``) for reference.

One Qwen3-30B-A3B-shaped MoE layer (128 experts, hidden 2048, expert FFN 768, top-8), random weights, random top-8
routing of ``tokens`` prompt tokens; the wgmma GEMM runs at every size (``MIN_TOKENS_PER_EXPERT`` 0). Prints one
JSON line: device time per call (CUDA graphs, L2 flushed), and the output's relative difference between the two FP4
paths. ``wgmma_items_us``: the wgmma GEMM with one CTA per 128-row x expert item instead of its persistent grid.
Usage (H200):
    python3 benchmarks/bench_prefill_experts.py [--tokens 2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _timing import graph_ms, machine

from megatron_trace.config import TraceConfig
from megatron_trace.kernels import moe_mma, moe_wgmma
from megatron_trace.rollout.fp4_moe import grouped_experts_forward

E, H, FFN, TOP_K = 128, 2048, 768, 8


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,4096,8192")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = TraceConfig()
    wq, aq = cfg.weight_quantizer(), cfg.activation_quantizer()
    fc1_bf16 = (torch.randn(E, 2 * FFN, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    fc2_bf16 = (torch.randn(E, H, FFN, device="cuda") * FFN**-0.5).to(torch.bfloat16)
    fc1, fc2 = wq.quantize(fc1_bf16), wq.quantize(fc2_bf16)
    w1, w2 = moe_wgmma.pack(fc1), moe_wgmma.pack(fc2)
    rows = []
    for t in [int(v) for v in a.tokens.split(",")]:
        hidden = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        idx = torch.rand(t, E, device="cuda").topk(TOP_K, dim=1).indices
        wts = torch.softmax(torch.randn(t, TOP_K, device="cuda"), -1)

        def run(packed1=None, packed2=None, f1=fc1, f2=fc2, hidden=hidden, idx=idx, wts=wts):
            return grouped_experts_forward(hidden, idx, wts, f1, f2, activation_quantizer=aq, packed_fc1=packed1,
                                           packed_fc2=packed2).out

        auto, min_tpe = moe_mma.AUTO, moe_wgmma.MIN_TOKENS_PER_EXPERT
        moe_mma.AUTO = False  # (the decode GEMM is not preferred at these sizes anyway)
        moe_wgmma.MIN_TOKENS_PER_EXPERT = 0  # (the wgmma GEMM at every size: where should the dispatch start?)
        tri_us = graph_ms(run) * 1e3
        wg_us = graph_ms(lambda: run(w1, w2)) * 1e3
        moe_wgmma.PERSISTENT = False
        items_us = graph_ms(lambda: run(w1, w2)) * 1e3
        moe_wgmma.PERSISTENT = True
        bf_us = graph_ms(lambda: run(f1=fc1_bf16, f2=fc2_bf16)) * 1e3
        diff = float((run(w1, w2).float() - run().float()).norm() / run().float().norm())
        moe_mma.AUTO, moe_wgmma.MIN_TOKENS_PER_EXPERT = auto, min_tpe
        row = {"tokens": t, "tok_per_expert": t * TOP_K / E, "triton_us": round(tri_us, 1), "wgmma_us": round(wg_us, 1),
               "wgmma_items_us": round(items_us, 1), "bf16_weights_us": round(bf_us, 1),
               "wgmma_vs_triton": round(tri_us / wg_us, 3), "wgmma_vs_bf16": round(bf_us / wg_us, 3),
               "rel_diff_wgmma_triton": float(f"{diff:.2e}")}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    res = {"bench": "prefill_experts", "shape": [E, H, FFN, TOP_K], "machine": machine(), "results": rows}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
