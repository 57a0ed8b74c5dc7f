#!/usr/bin/env bash
# Session 21, call 8: the stacked weights' fake-quant (amaxes in two launches) against session 20's path (torch-op
# amaxes given per row), both with the step's deferred counter (call 2's given-amax op synced inside the graph
# capture); host time per call once more.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 80 python3 benchmarks/bench_quant.py --ops "stacked_weights,given_amax_weights,fake_quant_rne+ste_mask" \
    > "$OUT/quant.json" 2> "$OUT/quant.err"; grep "of copy" "$OUT/quant.err" || tail -3 "$OUT/quant.err"
timeout 60 python3 benchmarks/bench_host_overhead.py > "$OUT/host_overhead.json" 2> "$OUT/host_overhead.err"
grep us/call "$OUT/host_overhead.err"
