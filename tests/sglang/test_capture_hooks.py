"""Capture hooks and records against SGLang 0.5.10's own conventions: slot range, call shapes, hook paths."""

from types import SimpleNamespace

import pytest
import torch

from megatron_trace.formats import mxfp4, nvfp4
from megatron_trace.rollout.sglang.capture import (
    INFO_KEY,
    READOUT_PREFIX,
    active_capture,
    make_attention_hook,
    make_logits_hook,
    set_capture,
)
from megatron_trace.rollout.sglang.records import SiteSpec, assemble, encode_rows

FC1 = SiteSpec(0, "expert_fc1_in", (32,))
CONFIG = {"specs": [dict(layer=0, site="expert_fc1_in", row_shape=[32], fmt="nvfp4", compact=True)]}


@pytest.fixture(autouse=True)
def _no_capture():
    set_capture(None)
    yield
    set_capture(None)


def _sglang_source(rel: str) -> str:
    import importlib.util
    import os

    return open(os.path.join(os.path.dirname(importlib.util.find_spec("sglang").origin), rel)).read()


def _fb(loc, **kw):
    return SimpleNamespace(out_cache_loc=torch.tensor(loc), token_to_kv_pool=SimpleNamespace(size=4, page_size=1), **kw)


def test_the_last_slot_sglang_hands_out_is_recorded():
    """SGLang's allocator hands out slots 1..size (0: the padded tokens' dummy) and its KV buffers hold
    size + page_size rows: the slot buffers, sized at the first bind, hold the last slot too."""
    pytest.importorskip("sglang")
    assert "1, self.size + 1, dtype=torch.int64" in _sglang_source("srt/mem_cache/allocator.py")
    pool_src = _sglang_source("srt/mem_cache/memory_pool.py")
    assert "(self.size + self.page_size, self.head_num, self.head_dim)" in pool_src
    make_attention_hook(CONFIG)(None, (None, None, None, _fb([4, 1])), None)  # slot 4 = pool.size
    x = torch.randn(2, 32)
    active_capture().record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    got = active_capture().gather(torch.tensor([4, 1]))[FC1.wire_key]
    assert torch.equal(got, encode_rows(nvfp4.quantize(x, per_row=True), FC1))


def test_logits_hook_finds_the_forward_batch_as_qwen3_moe_calls_it():
    """Qwen3-MoE calls ``logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``:
    the ForwardBatch is the 4th positional argument, not the last."""
    make_attention_hook(CONFIG)(None, (None, None, None, _fb([3, 2])), None)
    x = torch.randn(2, 32)
    active_capture().record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    req_to_token = torch.tensor([[3, 2, 0, 0]], dtype=torch.int32)
    fb = _fb([1], rids=[f"{READOUT_PREFIX}x-0"], forward_mode=SimpleNamespace(is_extend=lambda: True),
             req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), req_pool_indices=torch.tensor([0]),
             extend_prefix_lens_cpu=[2])
    out = SimpleNamespace(customized_info={"other": [1]})
    make_logits_hook(CONFIG)(None, (None, None, None, fb, None), out)  # aux_hidden_states=None
    assert out.customized_info["other"] == [1]
    (payload,) = out.customized_info[INFO_KEY]
    assert payload["n"] == 2 and payload["sites"][FC1.wire_key] == \
        encode_rows(nvfp4.quantize(x, per_row=True), FC1).numpy().tobytes()
    decode = SimpleNamespace(**{**vars(fb), "forward_mode": SimpleNamespace(is_extend=lambda: False),
                                "extend_prefix_lens_cpu": None})
    out = SimpleNamespace(customized_info=None)
    make_logits_hook(CONFIG)(None, (None, None, None, decode), out)  # decode forwards read nothing out
    assert out.customized_info is None


def test_hook_factories_resolve_as_sglang_resolves_them():
    """SGLang imports each ``hook_factory`` path itself (``hook_manager.resolve_callable``): the slot binding must
    be the attention's hook and the read-out the logits processor's."""
    pytest.importorskip("sglang")
    from sglang.srt.model_executor.hook_manager import resolve_callable

    from megatron_trace.rollout.sglang.launch import hook_specs

    got = {h["target_modules"][0]: resolve_callable(h["hook_factory"]) for h in hook_specs([FC1])}
    assert got == {"model.layers.*.self_attn.attn": make_attention_hook, "logits_processor": make_logits_hook}


def test_a_new_hook_config_gets_a_capture_of_its_own_specs():
    make_attention_hook(CONFIG)
    fc2 = {"specs": [dict(layer=1, site="expert_fc2_in", row_shape=[2, 16], fmt="nvfp4", compact=False)]}
    make_logits_hook(fc2)
    assert set(active_capture().specs) == {(1, "expert_fc2_in")}
    assert not active_capture().specs[(1, "expert_fc2_in")].compact


def test_rows_of_another_format_are_refused():
    with pytest.raises(ValueError, match="do not match the spec nvfp4"):
        encode_rows(mxfp4.quantize(torch.randn(3, 32)), FC1)


def test_assemble_fills_every_position_and_needs_the_layer_s_routing():
    rows = encode_rows(nvfp4.quantize(torch.randn(3, 32), per_row=True), FC1)
    g = assemble([[{"start": 0, "n": 3, "sites": {FC1.wire_key: rows.numpy().tobytes()}}]], [FC1], seq_len=3)
    assert g[FC1.key].valid.tolist() == [[True] * 3]
    fc2 = SiteSpec(2, "expert_fc2_in", (2, 16))
    with pytest.raises(ValueError, match="expert_fc2_in of layer 2 needs the routing"):
        assemble([[]], [fc2], seq_len=3, routing={1: torch.zeros(1, 3, 2, dtype=torch.long)})
