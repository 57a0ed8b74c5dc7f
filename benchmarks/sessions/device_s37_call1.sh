# Session 37 call 1: every GPU test in one call (benchmarks/device_tests.sh) at the code with NVFP4's saturating
# encode scale (session 36: its GPU cases for the quantize/guided/dequant kernels, the three FP4 GEMMs and the KV
# attention paths had not run) and session 37's host records pinned after the steps' checks (new GPU test:
# test_several_microbatches_keep_their_host_records_pinned).
source benchmarks/_device_env.sh > /dev/null 2>&1
bash benchmarks/device_tests.sh
zcat "$OUT/pytest.txt.gz" | grep -E "saturated|test_rl_driver_gpu|pinned|host_guidance" | head -40
