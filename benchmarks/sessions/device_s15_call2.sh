#!/usr/bin/env bash
# (As run, but for the GEMM summary: an inline snippet then, `summarize_rows.py skew` since, the same lines.)
# Session 15, call 2: the W4A16 GEMM's COMPACT grid (programs over the experts with tokens only; call 1 suggested
# that the full grid's programs of experts without tokens cost most of the batch-1 time) with and without K slices:
# GPU tests, a repeat check of the join_k int64 test that failed once in call 1, the GEMM under random routing
# (batch 1-64) and with all experts active (1-256 tokens each), then FP4 decode at batch 1 / 8, 8K, auto vs full grid.
source benchmarks/_device_env.sh
exec > >(tee -a "$OUT/log.txt") 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short tests/kernels/test_moe_triton.py \
    tests/kernels/test_moe_slices.py 2>&1 | grep -E "passed|failed|FAILED|assert|Error" | head -20
timeout 60 python3 - <<'PY'
import torch
from megatron_trace.formats import Quantizer
from megatron_trace.kernels import moe_triton
gen = torch.Generator().manual_seed(0)
wq = Quantizer("nvfp4", per_row=True).quantize((torch.randn(3, 64, 256, generator=gen) * 0.02).cuda())
offs = torch.tensor([1, 1, 18], dtype=torch.int32).cuda()
x = torch.randn(21, 256, generator=gen).to(torch.bfloat16).cuda()
for cfg in ((16, 64, 32, 4, 1, True), (32, 128, 16, 4, 1)):
    outs = {}
    for wide in (False, True):
        moe_triton.WIDE_ELEMENTS = 0 if wide else 2**31
        ys = [moe_triton.grouped_mm(x, wq, offs, out_dtype=torch.float32, config=cfg, deq_asm=False, programs=0)
              for _ in range(20)]
        outs[wide] = ys
        print(cfg, "wide" if wide else "narrow", "distinct results of 20:",
              len({tuple(y.view(torch.int32).flatten().tolist()) for y in ys}))
    print(cfg, "narrow == wide (first):", torch.equal(outs[False][0], outs[True][0]),
          "max abs diff", (outs[False][0] - outs[True][0]).abs().max().item())
PY
timeout 200 python3 benchmarks/bench_moe_skew.py --shapes qwen3_fc1,qwen3_fc2 --batches 1,4,8,16,32,64 \
    > "$OUT/moe_skew.jsonl" 2> "$OUT/moe_skew.err"; tail -1 "$OUT/moe_skew.err"
python3 benchmarks/summarize_rows.py skew "$OUT/moe_skew.jsonl"
timeout 120 python3 benchmarks/bench_moe_gemm.py --shapes qwen3_fc1,qwen3_fc2 --tokens 1,4,16,64,256 \
    > "$OUT/moe_gemm.jsonl" 2> "$OUT/moe_gemm.err"; grep -v Warn "$OUT/moe_gemm.err" | tail -12
export TORCHDYNAMO_DISABLE=0
for grid in auto full; do
  timeout 80 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes fp4 --batches 1,8 \
      --prompts 8192 --steps 24 --compile layers --graph-only --gemm-grid $grid > "$OUT/decode_$grid.jsonl" \
      2> "$OUT/decode_$grid.err"
  tail -1 "$OUT/decode_$grid.err"; cut -c1-240 "$OUT/decode_$grid.jsonl"
done
