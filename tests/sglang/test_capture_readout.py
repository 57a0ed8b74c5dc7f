"""Slot capture and read-out edges the end-to-end tests do not reach: KV sites hold no slot buffer, a BF16 KV pool
is refused by name, a hook config's defaults, a read-out mixed into a batch of ordinary requests, bytes that do not
fill the rows they claim."""

import re
from types import SimpleNamespace

import pytest
import torch

from megatron_trace.formats import nvfp4, sglang_kvfp4
from megatron_trace.rollout.sglang.capture import (
    INFO_KEY,
    READOUT_PREFIX,
    SlotCapture,
    kv_rows,
    make_attention_hook,
    make_logits_hook,
    readout_payloads,
    set_capture,
    specs_from_config,
)
from megatron_trace.rollout.sglang.records import SiteSpec, assemble, encode_rows

FC1 = SiteSpec(0, "expert_fc1_in", (32,))
KV = SiteSpec(0, "kv_v", (2, 32), fmt=sglang_kvfp4.NAME)


@pytest.fixture(autouse=True)
def _no_capture():
    set_capture(None)
    yield
    set_capture(None)


def test_kv_sites_get_no_slot_buffer():
    """K/V rows are read from SGLang's FP4 KV pool: only expert sites cost slot-buffer memory."""
    cap = SlotCapture([FC1, KV], num_slots=8)
    assert set(cap.buffers) == {FC1.key} and cap.nbytes() == 8 * FC1.nbytes


def test_kv_rows_of_a_pool_without_fp4_scales_are_refused_by_name():
    """A BF16 KV pool (``k_buffer`` but no ``k_scale_buffer``) holds no FP4 K/V to read."""
    pool = SimpleNamespace(k_buffer=[torch.zeros(4, 2, 32, dtype=torch.bfloat16)],
                           v_buffer=[torch.zeros(4, 2, 32, dtype=torch.bfloat16)], start_layer=0)
    with pytest.raises(RuntimeError, match=r"\(0, 'kv_v'\): KV guidance needs SGLang's FP4 KV pool .*SimpleNamespace"):
        kv_rows(pool, KV, torch.tensor([1, 2]))


def test_a_hook_config_without_fmt_or_compact_takes_site_spec_defaults():
    (spec,) = specs_from_config({"specs": [dict(layer="2", site="expert_fc2_in", row_shape=[2, 16])]})
    assert spec == SiteSpec(2, "expert_fc2_in", (2, 16)) and spec.fmt == "nvfp4" and spec.compact


def _batch(rids, prefix_lens, pool_idx):
    """Rows of slots 1..6 recorded; req_to_token row r holds slots (r*2+1, r*2+2, ...)."""
    config = {"specs": [dict(layer=0, site="expert_fc1_in", row_shape=[32], fmt="nvfp4", compact=True)]}
    make_attention_hook(config)(None, (None, None, None, SimpleNamespace(
        out_cache_loc=torch.arange(1, 7), token_to_kv_pool=SimpleNamespace(size=8, page_size=1))), None)
    x = torch.randn(6, 32)
    from megatron_trace.rollout.sglang.capture import active_capture

    active_capture().record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    req_to_token = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 0], [6, 5, 4, 3]], dtype=torch.int32)
    fb = SimpleNamespace(out_cache_loc=torch.arange(7, 7 + len(rids)), rids=rids,
                         forward_mode=SimpleNamespace(is_extend=lambda: True),
                         token_to_kv_pool=SimpleNamespace(size=8, page_size=1),
                         req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                         req_pool_indices=torch.tensor(pool_idx), extend_prefix_lens_cpu=prefix_lens)
    return x, req_to_token, fb, config


def test_a_read_out_in_a_batch_of_other_requests_gets_its_own_rows_at_its_own_index():
    """SGLang may batch a read-out with ordinary requests: the payload list is aligned with the batch (None for
    the others) and each read-out request reads its own req_to_token row up to its own cached prefix."""
    rids = ["user-a", f"{READOUT_PREFIX}t-0", "user-b", f"{READOUT_PREFIX}t-1"]
    x, _, fb, config = _batch(rids, prefix_lens=[0, 3, 1, 2], pool_idx=[2, 1, 2, 0])
    out = SimpleNamespace(customized_info=None)
    make_logits_hook(config)(None, (None, None, None, fb), out)
    got = out.customized_info[INFO_KEY]
    assert len(got) == 4 and got[0] is None and got[2] is None
    rows = encode_rows(nvfp4.quantize(x, per_row=True), FC1)  # row j = slot j + 1
    assert got[1] == {"start": 0, "n": 3, "sites": {FC1.wire_key: rows[3:6].numpy().tobytes()}}
    assert got[3] == {"start": 0, "n": 2, "sites": {FC1.wire_key: rows[0:2].numpy().tobytes()}}


def test_a_batch_without_read_outs_reads_nothing():
    _, _, fb, _ = _batch(["user-a", "user-b"], prefix_lens=[3, 3], pool_idx=[0, 1])
    assert readout_payloads(SlotCapture([FC1], num_slots=8), fb) is None


@pytest.mark.parametrize("raw_rows", [0, 1, 3])
def test_bytes_that_do_not_fill_the_rows_a_payload_claims_are_refused(raw_rows):
    """A payload of n=2 rows must carry 2 rows of bytes: none (or another count) is an error, not 2 invalid rows."""
    rows = encode_rows(nvfp4.quantize(torch.randn(raw_rows, 32), per_row=True), FC1).numpy().tobytes()
    want = f"has {len(rows)} bytes for n=2 rows of {FC1.nbytes} bytes (want {2 * FC1.nbytes})"
    with pytest.raises(ValueError, match=re.escape(f"request 0: {FC1.key}'s payload at position 0 {want}")):
        assemble([[{"start": 0, "n": 2, "sites": {FC1.wire_key: rows}}]], [FC1], seq_len=4)


def test_rows_of_a_layer_or_site_not_selected_leave_the_slots_as_they_are():
    cap = SlotCapture([FC1], num_slots=8)
    cap.bind(torch.tensor([1, 2]))
    x = torch.randn(2, 32)
    cap.record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    cap.record(1, "expert_fc1_in", nvfp4.quantize(torch.randn(2, 32) * 4, per_row=True))  # layer 1: not selected
    cap.record(0, "expert_fc2_in", nvfp4.quantize(torch.randn(2, 32) * 4, per_row=True))  # site: not selected
    got = cap.gather(torch.tensor([1, 2]))[FC1.wire_key]
    assert torch.equal(got, encode_rows(nvfp4.quantize(x, per_row=True), FC1))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_rows_that_are_not_bytes_are_refused(dtype):
    from megatron_trace.rollout.sglang.records import decode_rows

    with pytest.raises(ValueError, match=rf"expected uint8 \[N, {FC1.nbytes}\], got {dtype} \(2, {FC1.nbytes}\)"):
        decode_rows(torch.zeros(2, FC1.nbytes, dtype=dtype), FC1)


def test_a_payload_past_the_batch_length_keeps_its_rows_at_their_positions():
    x = torch.randn(3, 32)
    rows = encode_rows(nvfp4.quantize(x, per_row=True), FC1).numpy().tobytes()
    g = assemble([[{"start": 1, "n": 3, "sites": {FC1.wire_key: rows}}]], [FC1], seq_len=3)[FC1.key]
    assert g.valid.tolist() == [[False, True, True]]
    want = nvfp4.quantize(x[:2], per_row=True).guidance(compact=True)
    assert torch.equal(g.record.mantissa_bits[0, 1:], want.mantissa_bits)
    assert torch.equal(g.record.global_amax[0, 1:], want.global_amax)


@pytest.mark.parametrize("layer", [0, 1, 4])
def test_a_kv_layer_outside_the_pools_stage_is_refused_not_read_from_another_layer(layer):
    """A pool of a pipeline stage holding layers 2..3 (``start_layer=2``): layer 0 or 1 gave a negative index into
    its per-layer buffers, which Python reads from the end, silently returning layer 2's or 3's K/V as layer 0's."""
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8)  # noqa: E731
    codes, scales = [u8(8, 2, 16), u8(8, 2, 16)], [u8(8, 4), u8(8, 4)]
    pool = SimpleNamespace(k_buffer=codes, v_buffer=codes, k_scale_buffer=scales, v_scale_buffer=scales,
                           start_layer=2)
    spec = SiteSpec(layer, "kv_k", (2, 32), fmt=sglang_kvfp4.NAME)
    with pytest.raises(RuntimeError, match=rf"\({layer}, 'kv_k'\): layer {layer} is not in this KV pool \(layers 2 "
                                           r"\.\. 3"):
        kv_rows(pool, spec, torch.tensor([1, 2]))
    assert kv_rows(pool, SiteSpec(3, "kv_k", (2, 32), fmt=sglang_kvfp4.NAME), torch.tensor([1])).shape[0] == 1


def test_guidance_capture_refuses_pipeline_parallel_serving():
    """Only the last pipeline stage runs ``logits_processor`` (the read-out) and its slot buffers hold its own
    layers' rows: an earlier stage's guided layers would be read out as valid all-zero rows."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.sglang.launch import trace_server_args

    from ..rollout._tiny import tiny_config

    hf, cfg = {**tiny_config().to_dict(), "dtype": "bfloat16"}, TraceConfig(guided_layers="last_k", guided_last_k=2)
    assert trace_server_args("/ckpt", cfg, hf, native=False)["pp_size"] == 1
    with pytest.raises(ValueError, match="guidance capture needs pp_size=1, got 2: only the last pipeline stage"):
        trace_server_args("/ckpt", cfg, hf, native=False, pp_size=2)
    off = cfg.replace(guided_layers="none")  # nothing captured: nothing to refuse
    assert trace_server_args("/ckpt", off, hf, native=False, pp_size=2)["pp_size"] == 2
