#!/usr/bin/env bash
# Session 28, call 3: call 2 again, each CTA's first item b, then the counter's, each taken one item ahead (call 2
# waited for the atomic at every item: FC2 at 256 tokens 189.6 -> 195.2 us). "items" is one CTA per item. Its GPU tests
# (any grid gives the same bits), then Qwen3's FC1 / FC2 at 128 / 192 / 256 tokens per expert and DeepSeek-V3's FC1
# at 128 / 256, persistent against one CTA per item, and the rollout's experts forward at prefill sizes.
# The same commands as call 1:
bash "$(dirname "$0")/device_s28_call1.sh"
