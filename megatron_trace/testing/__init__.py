"""Support for running Megatron-Core on CPU in tests and the CPU demo. Never imported by product modules."""
