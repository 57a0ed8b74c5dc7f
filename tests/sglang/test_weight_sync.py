"""Weight sync plumbing without an engine: the custom loader's post-processing, the engine call's result and
errors, and the trainer end of the weight-update group (a one-rank gloo group stands in for NCCL)."""

import socket
import time
from datetime import timedelta

import pytest
import torch

from megatron_trace.rollout.sglang.weights import (
    WeightsUpdateGroup,
    _call_async,
    _join,
    load_and_postprocess,
)


class _Method:
    def __init__(self, native: bool, quant_config: bool):
        self.native, self.processed = native, []
        if quant_config:
            self.quant_config = object()

    def process_weights_after_loading(self, module):
        self.processed.append(module)


class _Model(torch.nn.Module):
    """SGLang's model surface the loader uses: ``load_weights`` and ``modules()`` with ``quant_method``s."""

    def __init__(self):
        super().__init__()
        self.native, self.emulated, self.other, self.plain = (torch.nn.Module() for _ in range(4))
        self.native.quant_method = _Method(True, True)  # TRACE's native NVFP4 method
        self.emulated.quant_method = _Method(False, True)  # TRACE's emulation: loads the raw weights as they are
        self.other.quant_method = _Method(True, False)  # not a TRACE method
        self.loaded = []

    def load_weights(self, named):
        self.loaded.append(list(named))


def test_the_custom_loader_loads_then_post_processes_native_trace_modules_only():
    model = _Model()
    named = [("a.weight", torch.ones(2))]
    load_and_postprocess(model, named)
    assert [[n for n, _ in x] for x in model.loaded] == [["a.weight"]]
    assert model.native.quant_method.processed == [model.native]
    assert model.emulated.quant_method.processed == [] and model.other.quant_method.processed == []


def test_an_engine_call_that_reports_failure_raises_and_its_error_is_raised():
    t = timedelta(seconds=5)
    assert _join(_call_async(lambda **kw: (True, "ok", kw), x=1), t, "f") == (True, "ok", {"x": 1})
    with pytest.raises(RuntimeError, match="engine.update_weights_from_distributed failed: bad shape"):
        _join(_call_async(lambda: (False, "bad shape")), t, "update_weights_from_distributed")

    def boom():
        raise KeyError("no such group")

    with pytest.raises(KeyError, match="no such group"):
        _join(_call_async(boom), t, "init_weights_update_group")
    with pytest.raises(TimeoutError, match=r"engine.slow did not finish within 0 s"):
        _join(_call_async(lambda: time.sleep(2)), timedelta(seconds=0.05), "slow")


class _Engine:
    """Records the calls SGLang's Engine gets (``init_weights_update_group``, ``update_weights_from_distributed``)."""

    def __init__(self):
        self.calls = []

    def init_weights_update_group(self, **kw):
        self.calls.append(("init", kw))
        return True, "ok"

    def update_weights_from_distributed(self, **kw):
        self.calls.append(("update", kw))
        return True, "ok"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_trainer_joins_as_rank_0_and_announces_names_dtypes_and_shapes_as_sglang_parses_them():
    """SGLang's ``update_weights_from_distributed`` builds each receive buffer from ``getattr(torch, dtype)``: dtype
    names without the ``torch.`` prefix, in the order the tensors are broadcast; the engine's ranks start at 1."""
    port = _free_port()
    eng = _Engine()
    g = WeightsUpdateGroup(eng, master_address="127.0.0.1", master_port=port, tp_size=0, backend="gloo",
                           group_name=f"trace_weights_test_{port}", timeout_s=30)
    assert eng.calls == [("init", dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=1,
                                       group_name=f"trace_weights_test_{port}", backend="gloo"))]
    # (gloo broadcasts no float8: the FP4 weight's uint8 codes and float32 global scales stand for its tensors)
    named = [("model.layers.1.mlp.experts.3.down_proj.weight", torch.zeros(64, 16, dtype=torch.uint8)),
             ("model.layers.1.mlp.experts.3.down_proj.weight_scale_2", torch.ones(())),
             ("model.norm.weight", torch.ones(32, dtype=torch.bfloat16)), ("ids", torch.arange(3))]
    g.send(named, flush_cache=False)
    (_, kw) = eng.calls[1]
    assert kw["names"] == [n for n, _ in named] and kw["shapes"] == [[64, 16], [], [32], [3]]
    assert kw["dtypes"] == ["uint8", "float32", "bfloat16", "int64"]
    assert all(isinstance(getattr(torch, d), torch.dtype) for d in kw["dtypes"])
    assert kw["group_name"] == f"trace_weights_test_{port}" and kw["flush_cache"] is False
    g.send(named)  # the backend's call: SGLang flushes its radix cache (the old weights' KV and guidance rows)
    assert eng.calls[2][0] == "update" and eng.calls[2][1]["flush_cache"] is True
    torch.distributed.destroy_process_group(g.group)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
                                  "model.embed_tokens.weight"])
def test_fp4_values_of_other_than_routed_expert_weights_are_refused(name):
    """The engine holds packed NVFP4 for routed experts only: an FP4 attention, router or embedding weight would
    be sent as ``{name}_scale`` tensors no SGLang parameter has."""
    from megatron_trace.formats import nvfp4
    from megatron_trace.rollout.sglang.weights import engine_tensors

    with pytest.raises(ValueError, match=f"{name!r}: FP4 values are accepted for routed-expert weights only"):
        engine_tensors([(name, nvfp4.quantize(torch.randn(32, 32), per_row=False))])


def _sglang_args(**kw):
    """SGLang's own ``ServerArgs`` (``model_path="dummy"``: built on the CPU, nothing device-specific resolved)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(pp_size=2), r"needs the engine's pp_size=1, got 2: SGLang numbers each engine rank rank_offset \+ tp_rank"),
    (dict(dp_size=2), r"needs the engine's dp_size=1 or enable_dp_attention=True, got dp_size=2 without DP"),
    (dict(tp_size=2), r"tp_size=1 but the engine's server_args.tp_size is 2: the group would wait for 2 ranks"),
], ids=["pp2", "dp2", "tp_mismatch"])
def test_an_engine_whose_ranks_are_not_1_to_tp_is_refused_before_any_group_call(kw, match):
    """SGLang numbers an engine rank ``rank_offset + tp_rank``: with pp_size or dp_size (no DP attention) > 1 several
    schedulers claim each rank, and a tp_size other than the engine's counts another world size. The group was
    made anyway and the trainer's rendezvous waited out its timeout (600 s by default)."""
    pytest.importorskip("sglang.srt.server_args")
    eng = _Engine()
    eng.server_args = _sglang_args(**kw)
    port = _free_port()
    with pytest.raises(ValueError, match=match):
        WeightsUpdateGroup(eng, master_address="127.0.0.1", master_port=port, backend="gloo", timeout_s=2,
                           tp_size=1 if "tp_size" in kw else None, group_name=f"trace_weights_test_{port}")
    assert eng.calls == []


def test_the_group_counts_the_engines_tp_ranks_from_its_server_args():
    """1 + tp_size ranks: the engine's TP group; with DP attention the DP ranks are those TP ranks (SGLang launches
    tp_size schedulers, tp_rank 0..tp_size-1). An engine object without server_args needs tp_size given."""
    pytest.importorskip("sglang.srt.server_args")
    from megatron_trace.rollout.sglang.weights import engine_group_ranks

    assert engine_group_ranks(_sglang_args()) == 1
    assert engine_group_ranks(_sglang_args(tp_size=4), 4) == 4
    assert engine_group_ranks(_sglang_args(tp_size=2, dp_size=2, enable_dp_attention=True)) == 2
    with pytest.raises(ValueError, match=r"_Engine has no server_args to read the engine's tp_size from: pass tp_size"):
        WeightsUpdateGroup(_Engine(), master_address="127.0.0.1", master_port=_free_port(), backend="gloo")
