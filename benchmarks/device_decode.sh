#!/usr/bin/env bash
# Issue 8 items 3-4 in one device call on nvidia-h200 (< 240 s): GPU tests of the fused FP4-KV decode attention and
# the hf rollout's GPU path, then bench_decode.py (bf16 / fp4f / fp4 / fp4u x batch x context: eager + CUDA graph,
# profile shares, per-layer attention micro-benchmark, generate()). Run from the repo root:
#   bash benchmarks/device_decode.sh  -> $OUT/{decode.jsonl,decode.log,pytest.log,smi.txt,decode.png if matplotlib}
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-232}
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/smi.txt"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
timeout ${TEST_TIMEOUT:-80} python3 -m pytest tests/gpu/test_kv_attention_gpu.py tests/gpu/test_rollout_gpu.py -q \
    -p no:cacheprovider $XDIST 2>&1 | tail -30 > "$OUT/pytest.log"
echo "pytest rc=$? after ${SECONDS}s"; tail -3 "$OUT/pytest.log"
LEFT=$((TOTAL_S - SECONDS - 8))
timeout $LEFT python3 benchmarks/bench_decode.py --budget-s $((LEFT - 25)) --profile --attn-micro \
    --generate-batches ${GEN_BATCHES:-8,64} --out "$OUT/decode.jsonl" ${DECODE_ARGS:-} > "$OUT/decode.log" 2>&1
echo "bench_decode rc=$? after ${SECONDS}s"
python3 - "$OUT/decode.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    b, p = r.get("bench"), r.get("profile", {})
    if b == "decode":
        g = r.get("graph_tok_s", r.get("graph_error", r.get("error", "-")))
        print(f"{r['mode']:4s} B={r['batch']:3d} L={r['context']:6d} eager {r.get('eager_tok_s', '-'):>9} graph "
              f"{str(g)[:60]:>9} attn {p.get('attention_share', '-')} kv {p.get('kv_update_share', '-')} "
              f"moe {p.get('moe_share', '-')} step_gpu_ms {p.get('step_ms', '-')}")
    elif b in ("decode_attn", "decode_generate", "decode_summary", "decode_setup"):
        print(json.dumps({k: v for k, v in r.items() if k != "model"})[:700])
PY
python3 -c "import matplotlib" 2>/dev/null && python3 benchmarks/plot_decode.py "$OUT/decode.jsonl" "$OUT/decode.png"
echo "done after ${SECONDS}s"
true
