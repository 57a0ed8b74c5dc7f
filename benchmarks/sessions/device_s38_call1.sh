# Session 38 call 1 (for a short device budget): only the GPU cases new since the last device run (session 36's
# saturated NVFP4 encode scale through the quantize/guided/dequant kernels, the three FP4 GEMMs and KV attention;
# the RL driver's GPU test; session 37's host records pinned after the steps' checks), then the Megatron GPU tests
# (session 38's record check at check_site) in the time left.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -v -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu tests/kernels \
    -k "saturated or pinned or host_guidance or rl_driver" > "$OUT/pytest_new.txt" 2>&1
echo "new cases: pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_new.txt" | head; tail -1 "$OUT/pytest_new.txt"
timeout $((380 - SECONDS)) python3 -m pytest -v -p no:cacheprovider -rfEs --tb=short tests/gpu/test_megatron_gpu.py \
    > "$OUT/pytest_megatron.txt" 2>&1
echo "megatron gpu: pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_megatron.txt" | head
tail -1 "$OUT/pytest_megatron.txt"
