#!/usr/bin/env bash
# Session 48's device calls (carrying .whl), from the repo root on the device box:
#   bash benchmarks/sessions/device_s48.sh <call> [args]; results under $OUT, copied to benchmarks/results/s48/.
#   asis     issue 8's goals at the current code on one machine: the kernels' bandwidth (bench_quant.py, all ops,
#            32768 x 2048 bf16); the CUDA FP4 grouped GEMM on packed weights against bf16 torch._grouped_mm at 1-16
#            tokens per expert (bench_moe_mma.py --packed, NVFP4 and MXFP4, Qwen3-30B-A3B's FC1 / FC2, as session
#            26) and the wgmma GEMM at 256 (bench_moe_wgmma.py, as session 28); then the decode curve
#            (benchmarks/device_decode.sh: its GPU tests, then bench_decode.py over batch and context). It leaves more
#            than the 8 files the device returns: in session 48 $OUT/wgmma.json and $OUT/decode/ did not come back
#            (their summaries are in the call's printed output)
#   curve    the goal table's decode curve at the current code, as session 30's call 5: graph-replayed steps of the
#            Qwen3-30B-A3B-shaped 4-layer model (bench_static_decode.py, generate's decode path), BF16 vs FP4, batch
#            1 / 8 / 64 at 1K, 8K and 32K context
#   modes    bench_decode.py's modes after this session's change (fp4f, the backend's default fast FP4-KV attention,
#            beside fp4, its exact kernel): batch 64 / 8 at 8K context on the default 12-layer model, and generate()
source benchmarks/_device_env.sh > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
asis() {
    timeout 150 python3 benchmarks/bench_quant.py > "$OUT/quant.json" 2> "$OUT/quant.err"
    echo "bench_quant rc=$? at ${SECONDS}s"
    for fmt in nvfp4 mxfp4; do
        timeout 100 python3 benchmarks/bench_moe_mma.py --fmt $fmt --tokens 1,2,4,8,16 --variants "" --packed \
            > "$OUT/moe_mma_$fmt.json" 2> "$OUT/moe_mma_$fmt.err"
        echo "bench_moe_mma $fmt rc=$? at ${SECONDS}s"
        python3 benchmarks/moe_mma_summary.py "$OUT/moe_mma_$fmt.json"
    done
    timeout 100 python3 benchmarks/bench_moe_wgmma.py --shapes qwen3_fc1,qwen3_fc2 --tokens 256 \
        > "$OUT/wgmma.json" 2> "$OUT/wgmma.err"
    echo "bench_moe_wgmma rc=$? at ${SECONDS}s"
    python3 benchmarks/summarize_rows.py wgmma "$OUT/wgmma.json"
    OUT="$OUT/decode" TOTAL_S=$((575 - SECONDS)) bash benchmarks/device_decode.sh
}
curve() {
    TORCHDYNAMO_DISABLE=0 timeout 540 python3 benchmarks/bench_static_decode.py --shape qwen3-30b-a3b --modes bf16,fp4 \
        --batches 1,8,64 --prompts 1024,8192,32768 --steps 24 --compile layers --graph-only \
        > "$OUT/decode_curve.jsonl" 2> "$OUT/decode_curve.err"
    echo "rc=$? at ${SECONDS}s"; tail -3 "$OUT/decode_curve.err"; cut -c1-240 "$OUT/decode_curve.jsonl"
}
modes() {
    timeout 240 python3 benchmarks/bench_decode.py --modes bf16,fp4f,fp4 --batches 64,8 --lengths 8192 --profile \
        --generate-batches 8 --gen-reps 2 --budget-s 220 --out "$OUT/decode_modes.jsonl" > "$OUT/decode_modes.log" 2>&1
    echo "rc=$? at ${SECONDS}s"; tail -3 "$OUT/decode_modes.log"; cut -c1-400 "$OUT/decode_modes.jsonl"
}
"${1:?name a call: asis, curve or modes}" "${@:2}"
