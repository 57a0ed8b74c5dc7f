"""``GuidanceSync`` over NCCL, one GPU per rank: the scenarios of tests/guidance/test_sync.py (gloo) with the sync's
buffers on the GPUs. Every rank's worker asserts what it sent or received (records bit-exact, rejections named,
aborts that end a receive at once, a dead trainer rank that does not starve the others); a scenario needs as many
GPUs as ranks (NCCL refuses two ranks on one GPU), so on a machine of two GPUs the three-rank scenarios skip."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
    pytest.skip("needs CUDA and NCCL (the gloo runs: tests/guidance/test_sync.py)", allow_module_level=True)

from tests.guidance._dist import run_scenario  # noqa: E402

pytestmark = pytest.mark.gpu

SCENARIOS = [  # (ranks, scenario): one rollout rank, the rest trainer ranks
    (2, "round_robin"), (3, "round_robin"), (3, "mapping"), (3, "chunked"),
    (2, "corrupt"), (2, "corrupt_routing"), (2, "bad_magic"), (2, "old_protocol"), (2, "unchecked_sender"),
    (2, "resync"), (2, "resync_bad_header"), (3, "empty"),
    (3, "abort_midway"), (2, "missing_sender"), (3, "dead_trainer"),
]


@pytest.mark.parametrize(("world", "scenario"), SCENARIOS, ids=[f"{s}-{w}ranks" for w, s in SCENARIOS])
def test_guidance_sync_over_nccl(world, scenario, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"{scenario} needs {world} GPUs (one per NCCL rank), found {torch.cuda.device_count()}")
    run_scenario(world, scenario, tmp_path, timeout=180, backend="nccl")
