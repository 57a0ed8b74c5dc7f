# Session 34 call 4: call 3's one failing GPU test again, with its traceback kept.
source benchmarks/_device_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE --tb=long -p no:warnings \
    tests/gpu/test_megatron_gpu.py -k "schedule_with_host_guidance" > "$OUT/pytest.txt" 2>&1
echo "rc=$?"; grep -E "^E |Error|error|megatron_trace/.*py:[0-9]+|assert" "$OUT/pytest.txt" | tail -40
