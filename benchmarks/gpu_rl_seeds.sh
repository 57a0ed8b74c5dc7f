#!/usr/bin/env bash
# The RL main job's GPU evidence in one device call: every (seed, arm) of the GPU config as its own process,
# spread round-robin over the visible GPUs (the models are small: the GPUs are shared, the step times are
# therefore contended; see BENCHMARKS.md). The SFT warm-up runs once first (`arms=[]`); every arm reuses it.
# Run from the repo root with the wheels of megatron-core, mbridge, einops, hydra-core, omegaconf, antlr4 in
# ./.whl (carry .whl):
#   bash benchmarks/gpu_rl_seeds.sh [STEPS]     (env: SEEDS="0 1 2", ARMS="bf16 fp4_naive fp4_qat trace trace_full",
#                                               BUDGET_S=540, CONFIG=gpu, EXTRA="hydra overrides", PY=python3,
#                                               INSTALL_WHL=1, QM_EVERY=5: record quantization metrics every
#                                               QM_EVERY steps, 0 = never, for clean step times)
# Step-time overhead without contention: SEEDS=0 ARMS="fp4_qat trace" QM_EVERY=0 on two GPUs (one process each).
# -> $OUT/metrics_s<seed>_<arm>.jsonl and logs; summarise with benchmarks/rl_seeds_summary.py.
set -uo pipefail
STEPS=${1:-40}; SEEDS=${SEEDS:-0 1 2}; ARMS=${ARMS:-bf16 fp4_naive fp4_qat trace trace_full}
CONFIG=${CONFIG:-gpu}; BUDGET_S=${BUDGET_S:-540}; EXTRA=${EXTRA:-}
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
[[ "$BUDGET_S" =~ ^[0-9]+$ && "$BUDGET_S" -ge 1 ]] || { echo "BUDGET_S=$BUDGET_S must be whole seconds >= 1"; exit 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=2 TORCHDYNAMO_DISABLE=1
PY=${PY:-python3}
if [ -d .whl ] && [ "${INSTALL_WHL:-1}" = 1 ]; then
  source benchmarks/_install_wheels.sh || exit 1
fi
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l); DEVICE=cuda; [ "$NGPU" -gt 0 ] || { NGPU=1; DEVICE=cpu; }
T0=$SECONDS; i=0; pids=()
launch() {  # seed spec; spec = arm, or label=arm:override (a variant, e.g. trace75=trace:trace.guided_fraction=0.75)
  local left=$((BUDGET_S - (SECONDS - T0))) label=${2%%=*} arm=${2#*=} ovr=""
  [[ "$arm" == *:* ]] && { ovr=${arm#*:}; arm=${arm%%:*}; }
  # (a negative left made timeout refuse to start the arm; 0 would have run it without any limit)
  if [ "$left" -lt 1 ]; then echo "s$1 $label: not started, BUDGET_S=$BUDGET_S s spent"; return; fi
  CUDA_VISIBLE_DEVICES=$((i % NGPU)) MASTER_PORT=$((29600 + i)) timeout "$left" $PY examples/rl_demo.py \
    --config-name "$CONFIG" device=$DEVICE run_name="seeds_s$1_$label" rl.seed="$1" "arms=[$arm]" rl.steps="$STEPS" \
    progress=false rl.quant_metrics_every=${QM_EVERY:-5} $EXTRA $ovr > "$OUT/log_s$1_$label.txt" 2>&1 &
  pids+=($!); i=$((i + 1))
}
read -r -a seeds <<< "$SEEDS"; read -r -a arms <<< "$ARMS"
timeout 300 $PY examples/rl_demo.py --config-name "$CONFIG" device=$DEVICE "arms=[]" progress=false $EXTRA \
  > "$OUT/log_sft.txt" 2>&1 || { echo "SFT FAILED"; tail -n 20 "$OUT/log_sft.txt"; exit 1; }
echo "SFT ready after $((SECONDS - T0)) s"
if [ $((SECONDS - T0)) -ge "$BUDGET_S" ]; then
  echo "BUDGET_S=$BUDGET_S s is spent by the SFT warm-up ($((SECONDS - T0)) s): no time left for the arms; raise it"
  exit 1
fi
for s in "${seeds[@]}"; do for a in "${arms[@]}"; do launch "$s" "$a"; done; done
for p in "${pids[@]}"; do wait "$p"; echo "pid $p rc=$?"; done
for s in "${seeds[@]}"; do for a in "${arms[@]}"; do
  a=${a%%=*}
  cp "outputs/seeds_s${s}_$a/metrics.jsonl" "$OUT/metrics_s${s}_$a.jsonl" 2>/dev/null \
    && echo "s$s $a: $(wc -l < "$OUT/metrics_s${s}_$a.jsonl") steps" || echo "s$s $a: no metrics"
done; done
echo "wall $((SECONDS - T0)) s"
