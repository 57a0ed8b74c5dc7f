"""Checkpoints between stock and TRACE models: Megatron's distributed checkpoints (``dist_checkpointing``, the
``torch_dist`` backend Megatron-LM's ``--ckpt-format torch_dist`` writes, from ``sharded_state_dict()``) and plain
state dicts (``--ckpt-format torch``).

A stock checkpoint loads into a TRACE model strictly (no key missing or unexpected, in the checkpoint or the model)
and the reverse, also across expert-parallel sizes (saved at EP=2 by two gloo ranks, loaded at EP=1, and the
reverse); the TRACE modules hold no state of their own (no buffer, ``_extra_state`` or cached weight in either
kind of state dict); and a TRACE model that ran forwards before a load computes what a TRACE model built with the
loaded weights computes. On CPU the torch_dist writer needs psutil (an undeclared megatron-core import: without it
the writer's process raises and ``save`` waits forever) and ``torch.cuda.synchronize`` made a no-op
(``apply_cpu_shims``). Transformer Engine is absent here: ``TEGroupedMLP`` / ``TraceTEGroupedMLP`` are not built.
"""

import os

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import (
    expert_weights,
    find_trace_layers,
    reuse_weight_quant,
    trace_guidance,
    trace_spec,
)
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._dist_ckpt import load_like_megatron_lm, reshard_worker, save_like_megatron_lm
from .harness import EXPERTS, batch, build_model, ep_state_dict, free_port, logits, stock_spec, tiny_config

pytestmark = pytest.mark.usefixtures("world1")

TC = TraceConfig()  # experts (both inputs and weights) and the KV site
# expert-bias buffers of the router (sigmoid scores, DeepSeek-V3 style): Megatron's state, carried by both kinds
BIAS = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}


@pytest.fixture
def ckpt(tmp_path):
    """A directory for checkpoints; fails at once where psutil is missing (below)."""
    _require_psutil()
    return tmp_path


def _require_psutil() -> None:
    """Fail here, not in a save that never returns: megatron-core's torch_dist writer process calls psutil before
    its try block, so without it the process dies and ``dist_checkpointing.save`` waits for it forever."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        pytest.fail("psutil is not installed: megatron-core's torch_dist checkpoint writer needs it (an undeclared "
                    "import); pip install -e '.[megatron]'")


def _save(model, path) -> None:
    os.makedirs(path, exist_ok=True)
    save_like_megatron_lm(model, path)


_load = load_like_megatron_lm


def _tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    diff = [k for k in want if not torch.equal(got[k], want[k])]
    assert not diff, diff


def _models(cfg, tc=TC):
    """(stock with seed 0, TRACE with seed 1, stock with seed 1, TRACE with seed 0): two sets of weights."""
    spec = stock_spec(cfg)
    trace = trace_spec(spec, tc)
    return build_model(cfg, spec, seed=0), build_model(cfg, trace, seed=1), build_model(cfg, spec, seed=1), \
        build_model(cfg, trace, seed=0)


@pytest.mark.parametrize("overrides", [{}, BIAS], ids=["plain", "expert-bias"])
def test_dist_checkpoint_stock_to_trace_and_back(ckpt, overrides):
    cfg = tiny_config(**overrides)
    stock, trace, stock_b, _ = _models(cfg)
    assert any(".experts." in k for k in _tensors(stock))
    before = _tensors(trace)
    assert not any(torch.equal(before[k], v) for k, v in _tensors(stock).items() if ".linear_fc" in k)
    _save(stock, ckpt / "stock")
    _load(trace, ckpt / "stock")
    _assert_same_tensors(_tensors(trace), _tensors(stock))
    # and back: the TRACE model's checkpoint into a stock model with other weights
    _save(trace, ckpt / "trace")
    _load(stock_b, ckpt / "trace")
    _assert_same_tensors(_tensors(stock_b), _tensors(stock))


@pytest.mark.parametrize("tc", [TC, TraceConfig(kv_format="sglang_kvfp4"), TraceConfig(format="mxfp4"),
                                TraceConfig(activation_amax="per_tensor", exclude_modules=("model.layers.0.mlp.experts",
                                                                                            "model.layers.3.*"))],
                         ids=["default", "sglang-kv", "mxfp4", "per-tensor-excluded"])
def test_trace_modules_hold_no_state(tc):
    """Same keys, shapes and dtypes in ``state_dict()`` and ``sharded_state_dict()`` (Megatron-LM's layout and the
    singleton-shards one) as the stock model's, also after TRACE ran a recorded forward (pre-hooks installed, weights
    prepared): nothing TRACE-only is saved, so nothing TRACE-only is needed at a load or refused by a stock load."""
    cfg = tiny_config(**BIAS)
    stock, trace, _, _ = _models(cfg, tc)
    tokens, pos, mask, _ = batch()
    with trace_guidance(trace, None, record=True), torch.no_grad():
        trace(tokens, pos, mask)
    want, got = stock.state_dict(), trace.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        if torch.is_tensor(v):
            assert (got[k].shape, got[k].dtype) == (v.shape, v.dtype), k
        else:
            assert got[k] == v, k  # _extra_state (None for Megatron's local linears)
    for metadata in (None, {"singleton_local_shards": True}):
        want, got = stock.sharded_state_dict(metadata=metadata), trace.sharded_state_dict(metadata=metadata)
        assert _sharded_layout(got) == _sharded_layout(want)


def _sharded_layout(sharded: dict) -> dict:
    """{state dict key: (checkpoint key, global shape, global offset, dtype) or the object's checkpoint key}."""
    out = {}
    for k, v in sharded.items():
        items = v if isinstance(v, list) else [v]
        out[k] = []
        for item in items:
            if isinstance(item, ShardedTensor):
                out[k].append((item.key, item.global_shape, item.global_offset, item.dtype))
            elif isinstance(item, ShardedObject):
                out[k].append((item.key, item.global_shape, item.global_offset))
            else:  # a ShardedTensorFactory (GLU fc1: w and v halves)
                out[k].append((type(item).__name__, item.key, tuple(item.data.shape), item.data.dtype))
    return out


def test_loaded_trace_model_computes_like_one_built_with_the_weights(ckpt):
    """A TRACE model that ran forwards (experts' weights fake-quantized and prepared by the MoE layers' pre-hooks)
    and then loads a stock checkpoint gives the logits of a TRACE model built with those weights (no derived state
    kept from before the load), and its experts' weights stay packed (``expert_weights.stacked`` is no copy)."""
    cfg = tiny_config()
    stock, trace, _, direct = _models(cfg)
    _assert_same_tensors(_tensors(direct), _tensors(stock))  # same seed: the stock model's weights
    data = batch()
    find_trace_layers(trace)
    with trace_guidance(trace, None):
        old = logits(trace, data)
    _save(stock, ckpt / "stock")
    _load(trace, ckpt / "stock")
    with trace_guidance(trace, None):
        new = logits(trace, data)
    with trace_guidance(direct, None):
        want = logits(direct, data)
    assert not torch.equal(old, want)
    assert torch.equal(new, want)
    assert torch.equal(logits(trace, data), logits(direct, data))  # outside the context too
    for moe in find_trace_layers(trace).moe.values():
        for name in ("linear_fc1", "linear_fc2"):
            weights = expert_weights.of(moe.experts.local_experts, name)
            assert expert_weights.stacked(weights).data_ptr() == weights[0].data_ptr()


def test_load_inside_reuse_weight_quant_is_refused(ckpt):
    """The weights kept by ``reuse_weight_quant`` (fake-quantized once per step) are not used after a load inside
    the scope: the next forward raises instead of computing with the weights from before the load."""
    cfg = tiny_config()
    stock, trace, _, _ = _models(cfg)
    data = batch()
    _save(stock, ckpt / "stock")
    with reuse_weight_quant(trace):
        logits(trace, data)
        _load(trace, ckpt / "stock")
        with pytest.raises(RuntimeError, match="changed inside reuse_weight_quant"):
            logits(trace, data)


@pytest.mark.parametrize("overrides", [{}, BIAS], ids=["plain", "expert-bias"])
def test_plain_state_dict_stock_to_trace_and_back(tmp_path, overrides):
    """``--ckpt-format torch``: ``state_dict_for_save_checkpoint`` through ``torch.save``, ``load_state_dict``
    strict, both ways."""
    cfg = tiny_config(**overrides)
    stock, trace, stock_b, _ = _models(cfg)
    torch.save(stock.state_dict_for_save_checkpoint(), tmp_path / "stock.pt")
    trace.load_state_dict(torch.load(tmp_path / "stock.pt", weights_only=False), strict=True)
    _assert_same_tensors(_tensors(trace), _tensors(stock))
    torch.save(trace.state_dict_for_save_checkpoint(), tmp_path / "trace.pt")
    stock_b.load_state_dict(torch.load(tmp_path / "trace.pt", weights_only=False), strict=True)
    _assert_same_tensors(_tensors(stock_b), _tensors(stock))


@pytest.mark.slow
def test_reshard_between_expert_parallel_sizes(ckpt):
    """Stock and TRACE checkpoints saved at EP=2 (two gloo ranks) load at EP=1 into the other kind, and EP=1
    checkpoints load at EP=2 into the other kind (into the TRACE model with ``--ckpt-fully-parallel-load``'s
    strategy): every rank holds its slice of the reference weights, and the TRACE model loaded at EP=2 gives EP=1's
    logits."""
    world, overrides = 2, BIAS
    cfg = tiny_config(**overrides)
    stock, trace, _, direct = _models(cfg)
    ref = _tensors(stock)
    _save(stock, ckpt / "stock_ep1")
    _save(direct, ckpt / "trace_ep1")
    torch.save({"config": overrides, "trace_config": TC, "state_dict": ref}, ckpt / "shared.pt")
    for kind in ("stock", "trace"):
        (ckpt / f"{kind}_ep{world}").mkdir()  # (every rank's save needs it)
    port = free_port()
    codes = spawn_ranks(reshard_worker, world, lambda r: (r, world, port, str(ckpt)), timeout=240)
    msgs = [p.read_text() for p in (ckpt / f"error{r}.txt" for r in range(world)) if p.exists()]
    assert not msgs and all(c == 0 for c in codes), msgs or codes
    for rank in range(world):
        got = torch.load(ckpt / f"rank{rank}.pt", weights_only=False)
        want = ep_state_dict(ref, rank, world, EXPERTS)
        _assert_same_tensors(got["trace"], want)  # EP=1 stock checkpoint -> TRACE at EP=2
        _assert_same_tensors(got["stock"], want)  # EP=1 TRACE checkpoint -> stock at EP=2
        tokens, pos, mask, _ = batch(seed=rank)
        with trace_guidance(direct, None), torch.no_grad():
            assert torch.equal(got["trace_logits"], direct(tokens, pos, mask)), rank
    # EP=2 checkpoints -> EP=1 models of the other kind
    _load(trace, ckpt / "stock_ep2")
    _assert_same_tensors(_tensors(trace), ref)
    stock_b = build_model(cfg, stock_spec(cfg), seed=1)
    _load(stock_b, ckpt / "trace_ep2")
    _assert_same_tensors(_tensors(stock_b), ref)
