"""megatron_trace: TRACE rollout-guided FP4 QAT for MoE RL with Megatron-Core (arXiv 2610.07767)."""

__version__ = "0.1.0"
