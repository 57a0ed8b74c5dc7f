from ..megatron.conftest import world1  # noqa: F401  (the one-process Megatron world fixture)
