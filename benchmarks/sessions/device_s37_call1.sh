# Session 37 call 1: first the GPU cases new since the last device run (session 36's saturated NVFP4 encode scale
# through the quantize/guided/dequant kernels, the three FP4 GEMMs and KV attention; the RL driver's GPU test at its
# final tolerances; session 37's host records pinned after the steps' checks and the one-context schedule test),
# then every GPU test (benchmarks/device_tests.sh) in the time left.
source benchmarks/_device_env.sh > /dev/null 2>&1
timeout 200 python3 -m pytest -v -p no:cacheprovider -n 16 -rfEs --tb=short tests/gpu tests/kernels \
    -k "saturated or pinned or host_guidance or rl_driver" > "$OUT/pytest_new.txt" 2>&1
echo "new cases: pytest rc=$? after ${SECONDS}s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_new.txt" | head; tail -1 "$OUT/pytest_new.txt"
TEST_TIMEOUT=$((540 - SECONDS)) bash benchmarks/device_tests.sh
