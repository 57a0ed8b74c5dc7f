# Session 35 call 1: every GPU test in one call (benchmarks/device_tests.sh), which includes session 34's
# never-run-on-GPU test_one_context_over_the_schedule_with_host_guidance; its traceback is kept in full if it fails.
source benchmarks/_device_env.sh > /dev/null 2>&1
bash benchmarks/device_tests.sh
zcat "$OUT/pytest.txt.gz" | grep -E "schedule_with_host_guidance" | head -5
