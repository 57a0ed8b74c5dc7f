#!/usr/bin/env bash
# Session 27, call 1: every GPU test at 2499a3d (session 26's final kernel; its full suite had not run).
bash benchmarks/device_tests.sh
