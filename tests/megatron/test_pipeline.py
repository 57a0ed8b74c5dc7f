"""Pipeline parallelism (2 processes, gloo): Megatron's 1F1B and interleaved schedules inside one
``trace_guidance`` context given one StepGuidance per micro-batch give each stage the gradients, records and counts
of the whole model run one context per micro-batch (PP=1), bit for bit, with and without activation recompute.

Under 1F1B the first stage runs micro-batch 1's forward before micro-batch 0's backward, so a recompute pass that
took the latest forward's guidance (not the one it recomputes) would change the gradients."""

import pytest
import torch

from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._pipeline import pp_worker
from .harness import free_port
from .test_microbatches import _model, _per_microbatch, _same_records, make_rollout

pytestmark = [pytest.mark.usefixtures("world1"), pytest.mark.slow]

WORLD = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The whole model (PP=1), one context per micro-batch, on one thread like the workers; the files they read."""
    micro, guidance = make_rollout()
    model = _model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads, recorded, stats, _ = _per_microbatch(model, micro, guidance)
    finally:
        torch.set_num_threads(threads)
    workdir = tmp_path_factory.mktemp("pp")
    steps = [{"sites": g.sites, "routing": g.routing, "token_mask": m, "counter": FallbackCounter()}
             for g, m in guidance]
    torch.save({"state_dict": model.state_dict(), "micro": micro, "steps": steps}, workdir / "shared.pt")
    return workdir, grads, recorded, stats


@pytest.mark.parametrize("vpp,recompute", [(None, "none"), (None, "full"), (None, "selective_moe"), (2, "full")],
                         ids=["1f1b", "1f1b_full_recompute", "1f1b_moe_recompute", "interleaved_full_recompute"])
def test_pipeline_stages_equal_the_whole_model(reference, vpp, recompute):
    _stages_equal_the_whole_model(reference, vpp, recompute)


@pytest.mark.parametrize("stages,held", [
    (dict(num_layers_in_first_pipeline_stage=1), [[0], [1, 2, 3]]),
    (dict(num_layers_in_last_pipeline_stage=1), [[0, 1, 2], [3]]),
    (dict(pipeline_model_parallel_layout="Et|tttL"), [[0], [1, 2, 3]]),
], ids=["first_stage_1_layer", "last_stage_1_layer", "layout"])
def test_uneven_pipeline_stages_equal_the_whole_model(reference, stages, held):
    """Megatron's uneven split (``num_layers_in_first/last_pipeline_stage``, or a ``pipeline_model_parallel_layout``)
    offsets each stage's layer ids: the
    guidance, routing and records keyed by global layer id land on the layer that holds them (the guided layers,
    last_k=2, are then on one stage or split over both)."""
    ranks = _stages_equal_the_whole_model(reference, None, "none", stages)
    assert [r["layers"] for r in ranks] == held


def _stages_equal_the_whole_model(reference, vpp, recompute, stages=None) -> list[dict]:
    workdir, grads, recorded, stats = reference
    for f in workdir.glob("*rank*.pt"):
        f.unlink()
    port = free_port()
    codes = spawn_ranks(pp_worker, WORLD, lambda r: (r, WORLD, port, vpp, recompute, str(workdir), stages),
                        timeout=300)
    msgs = [e.read_text() for e in workdir.glob("error*.txt")]
    assert not msgs and all(c == 0 for c in codes), msgs or codes
    ranks = [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    got = {n: g for r in ranks for n, g in r["grads"].items()}
    assert sorted(got) == sorted(grads) and all(len(r["grads"]) for r in ranks)  # each stage its own part
    assert all(torch.equal(got[n], grads[n]) for n in grads), [n for n in grads if not torch.equal(got[n], grads[n])]
    total = {}
    for r in ranks:
        for key, v in r["stats"].items():
            total[key] = total.get(key, 0) + v
    assert total == stats
    for i, want in enumerate(recorded):  # each stage records its own layers of every micro-batch
        parts = [r["recorded"][i] for r in ranks]
        assert sorted(k for p in parts for k in p.sites) == sorted(want.sites)
        for p in parts:
            _same_records(p, type(want)(sites={k: want.sites[k] for k in p.sites},
                                        routing={k: want.routing[k] for k in p.routing}))
    return ranks
