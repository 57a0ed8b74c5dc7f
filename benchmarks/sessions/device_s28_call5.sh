#!/usr/bin/env bash
# Session 28, call 5: call 4's idea without its branch between the wgmmas: a last 256-token tile of at most 128 tokens
# runs its own copy of the stage loop, m64n128k16 on the tile's first half (mma_tile<..., 128>). The wgmma GPU tests,
# Qwen3's FC1 / FC2 at 256 and 320 (= 256 + 64) tokens per expert, and the rollout's experts forward at prefill sizes
# (random routing: about half the experts have a second, short tile at 4096 tokens).
# The same commands as call 4:
bash "$(dirname "$0")/device_s28_call4.sh"
