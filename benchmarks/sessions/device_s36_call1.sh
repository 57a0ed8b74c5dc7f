# Session 36 call 1 (to run when a device is lent): every GPU test in one call (benchmarks/device_tests.sh) at the
# code with NVFP4's saturating encode scale (S_enc = min(2688 / amax, FLT_MAX)). New GPU cases: the saturated
# encode scale through the quantize/guided/dequant kernels, the three FP4 GEMMs (Triton, mma.sync, wgmma) and the
# KV attention paths; also the RL driver's GPU test at session 35's final code (fp32 accumulation, tight tolerances).
source benchmarks/_device_env.sh > /dev/null 2>&1
bash benchmarks/device_tests.sh
zcat "$OUT/pytest.txt.gz" | grep -E "saturated|test_rl_driver_gpu" | head -40
