import os

# Megatron's jit_fuser is torch.compile; on CPU it triggers slow inductor builds. Tests run eager.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer tests (still run in CI unless -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped with a reason elsewhere)")


@pytest.fixture
def gen():
    return __import__("torch").Generator().manual_seed(0)
