#!/usr/bin/env bash
# Session 28, call 2: call 1 again, the persistent CTAs now taking their items from a counter (in order, as each
# finishes one) instead of b, b + G, ... (call 1 lost 6% to one CTA per item under random routing). Its GPU tests
# (any grid gives the same bits), then Qwen3's FC1 / FC2 at 128 / 192 / 256 tokens per expert and DeepSeek-V3's FC1
# at 128 / 256, persistent against one CTA per item, and the rollout's experts forward at prefill sizes.
# The same commands as call 1:
bash "$(dirname "$0")/device_s28_call1.sh"
