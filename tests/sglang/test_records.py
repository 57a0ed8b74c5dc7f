"""Guidance bytes: encode/decode round trip, capture -> payloads -> SiteGuidance."""

from types import SimpleNamespace

import pytest
import torch

from megatron_trace.formats import nvfp4
from megatron_trace.rollout.sglang.capture import SlotCapture
from megatron_trace.rollout.sglang.records import SiteSpec, assemble, decode_rows, encode_rows


@pytest.mark.parametrize("n", [6, 1])  # 1 row: its amax column slice counts as contiguous (a float32 view refused it)
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_encode_decode_round_trip(compact, n):
    q = nvfp4.quantize(torch.randn(n, 2, 40), per_row=True)  # K=40 pads to 48
    spec = SiteSpec(3, "expert_fc2_in", (2, 40), compact=compact)
    rec = decode_rows(encode_rows(q, spec), spec)
    want = q.guidance(compact=compact)
    payload = "mantissa_bits" if compact else "codes"
    assert torch.equal(getattr(rec, payload), getattr(want, payload))
    assert torch.equal(rec.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(rec.global_amax, want.global_amax) and rec.shape == want.shape


@pytest.mark.parametrize("n", [3, 1])  # 1: a decode step of one request
@pytest.mark.parametrize("site,row", [("expert_fc1_in", (32,)), ("expert_fc2_in", (2, 16))])
def test_a_per_tensor_amax_round_trips_at_any_row_count(site, row, n):
    """A per-tensor amax (the native path's, ``fp4_from_op``; ``activation_amax="per_tensor"``) is sent with every
    row: expanded to one row [1, 1] it counts as contiguous with stride 0, which a uint8 view refused."""
    q = nvfp4.quantize(torch.randn(n, *row), per_row=False)
    assert q.global_amax.dim() == 0
    spec = SiteSpec(0, site, row)
    rec = decode_rows(encode_rows(q, spec), spec)
    assert tuple(rec.global_amax.shape) == (n, *row[:-1], 1) and bool((rec.global_amax == q.global_amax).all())


def test_decode_of_no_rows_is_an_empty_record():
    spec = SiteSpec(3, "expert_fc2_in", (2, 40), compact=True)
    rec = decode_rows(torch.zeros(0, spec.nbytes, dtype=torch.uint8), spec)
    assert rec.shape == (0, 2, 40) and tuple(rec.mantissa_bits.shape) == (0, 2, 6)
    assert tuple(rec.block_scales.shape) == (0, 2, 3) and tuple(rec.global_amax.shape) == (0, 2, 1)


def test_a_read_out_of_no_rows_is_empty_bytes_and_leaves_its_positions_invalid():
    """A read-out request whose prefix left the radix cache reads 0 slots (``extend_prefix_lens`` 0): its rows
    encode to 0 bytes (the KV pool's too) and assemble into invalid positions (they raised: a reshape of 0 elements
    to [0, -1], ``frombuffer`` of no bytes)."""
    from megatron_trace.formats import sglang_kvfp4

    fc1 = SiteSpec(1, "expert_fc1_in", (32,))
    kv = SiteSpec(1, "kv_k", (2, 32), fmt=sglang_kvfp4.NAME)
    cap = SlotCapture([fc1, kv], num_slots=8)
    pool = SimpleNamespace(k_buffer=torch.zeros(2, 8, 2, 16, dtype=torch.uint8), start_layer=0,
                           k_scale_buffer=torch.zeros(2, 8, 4, dtype=torch.uint8))
    payload = cap.request_payload(torch.zeros(1, 8, dtype=torch.int32), 0, 0, pool)
    assert payload["n"] == 0 and payload["sites"] == {fc1.wire_key: b"", kv.wire_key: b""}
    g = assemble([[payload]], [fc1, kv], seq_len=3)
    assert not g[fc1.key].valid.any() and not g[kv.key].valid.any()
    q = nvfp4.quantize(torch.randn(0, 32), per_row=True)
    assert tuple(encode_rows(q, fc1).shape) == (0, fc1.nbytes)


def test_rejects_wrong_rows():
    spec = SiteSpec(0, "expert_fc1_in", (32,))
    with pytest.raises(ValueError, match="do not match the spec"):
        encode_rows(nvfp4.quantize(torch.randn(3, 16), per_row=True), spec)


def test_slot_capture_payloads_assemble_into_site_guidance():
    """Rows written at KV slots by two forwards (prefill, decode) are read back per request in position order."""
    spec1 = SiteSpec(1, "expert_fc1_in", (32,), compact=True)
    spec2 = SiteSpec(1, "expert_fc2_in", (2, 16), compact=False)
    cap = SlotCapture([spec1, spec2], num_slots=16)
    # prefill: request 0 has 3 prompt tokens (slots 5, 2, 9), request 1 has 2 (slots 4, 11)
    x, a = torch.randn(5, 32), torch.randn(5, 2, 16)
    cap.bind(torch.tensor([5, 2, 9, 4, 11]))
    cap.record(1, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
    cap.record(1, "expert_fc2_in", nvfp4.quantize(a, per_row=True))
    cap.record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))  # not selected: ignored
    # one decode step each (slots 7, 1)
    x2, a2 = torch.randn(2, 32), torch.randn(2, 2, 16)
    cap.bind(torch.tensor([7, 1]))
    cap.record(1, "expert_fc1_in", nvfp4.quantize(x2, per_row=True))
    cap.record(1, "expert_fc2_in", nvfp4.quantize(a2, per_row=True))
    req_to_token = torch.zeros(2, 8, dtype=torch.int32)  # SGLang's ReqToTokenPool.req_to_token layout
    req_to_token[0, :4] = torch.tensor([5, 2, 9, 7])
    req_to_token[1, :3] = torch.tensor([4, 11, 1])
    steps = [[cap.request_payload(req_to_token, 0, 4)], [cap.request_payload(req_to_token, 1, 3)]]
    routing = {1: torch.randint(0, 4, (2, 5, 2))}
    g = assemble(steps, [spec1, spec2], seq_len=5, routing=routing)
    fc1 = g[(1, "expert_fc1_in")]
    assert fc1.valid.tolist() == [[True, True, True, True, False], [True, True, True, False, False]]
    want = nvfp4.quantize(torch.cat([x[:3], x2[:1]]), per_row=True).guidance(compact=True)
    assert torch.equal(fc1.record.mantissa_bits[0, :4], want.mantissa_bits)
    assert torch.equal(fc1.record.global_amax[1, :2], nvfp4.quantize(x[3:], per_row=True).global_amax)
    fc2 = g[(1, "expert_fc2_in")]
    assert fc2.valid.shape == (2, 5, 2) and torch.equal(fc2.expert_ids, routing[1])
    assert torch.equal(fc2.record.codes[1, 2], nvfp4.quantize(a2[1:], per_row=True).codes[0])
    with pytest.raises(ValueError, match="routing"):
        assemble(steps, [spec2], seq_len=5)


def test_slot_capture_errors():
    spec = SiteSpec(0, "expert_fc1_in", (32,))
    cap = SlotCapture([spec])
    with pytest.raises(RuntimeError, match="pool size is unknown"):
        cap.bind(torch.tensor([1]))
    cap.bind(torch.tensor([1, 2]), num_slots=4)  # allocated at the first bind (an eager forward)
    assert cap.buffers[spec.key].shape == (4, spec.nbytes)
    with pytest.raises(RuntimeError, match="3 rows but 2 KV slots"):
        cap.record(0, "expert_fc1_in", nvfp4.quantize(torch.randn(3, 32), per_row=True))
    with pytest.raises(ValueError, match="sglang_kvfp4"):
        SlotCapture([SiteSpec(0, "kv_k", (2, 16))])


def test_mantissa_bytes_against_a_bit_loop():
    from megatron_trace.rollout.sglang.records import mantissa_bytes

    codes = torch.randint(0, 256, (3, 5, 24), dtype=torch.uint8)  # packed codes of K = 48
    want = torch.zeros(3, 5, 6, dtype=torch.uint8)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in codes.shape)).tolist():
        byte = int(codes[tuple(idx)])
        for j, nibble in enumerate((byte & 0xF, byte >> 4)):  # element 2i (low nibble) then 2i+1
            e = 2 * idx[2] + j
            want[idx[0], idx[1], e // 8] |= (nibble & 1) << (e % 8)
    assert torch.equal(mantissa_bytes(codes), want)


TRACE_SCRIPT = """
import torch
from megatron_trace.formats import nvfp4
from megatron_trace.rollout.sglang.capture import SlotCapture
from megatron_trace.rollout.sglang.records import SiteSpec

graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
def targets(gm):
    return {n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            for n in gm.graph.nodes}
SYNC = {"item", "tolist", "cpu", "numpy", "_local_scalar_dense", "nonzero"}
specs = [SiteSpec(0, "expert_fc1_in", (32,), compact=True), SiteSpec(0, "expert_fc2_in", (2, 16), compact=False)]
cap, ref = SlotCapture(specs, num_slots=16), SlotCapture(specs, num_slots=16)
q1 = nvfp4.quantize(torch.randn(4, 32), per_row=True)
q2 = nvfp4.quantize(torch.randn(4, 2, 16), per_row=True)
def step(c, loc):
    c.bind(loc)
    c.record(0, "expert_fc1_in", q1)
    c.record(0, "expert_fc2_in", q2)
loc = torch.tensor([3, 1, 7, 2])
torch.compile(lambda loc: step(cap, loc), fullgraph=True, backend=backend)(loc)
step(ref, loc)
same = all(torch.equal(cap.buffers[k], ref.buffers[k]) for k in ref.buffers)
found = sorted(set().union(*map(targets, graphs)) & SYNC)
graphs.clear()
torch.compile(lambda loc: loc + int(loc.max()), fullgraph=True, backend=backend)(loc)  # the detector works
print("RESULT", same, found, sorted(targets(graphs[0]) & SYNC))
"""


def test_slot_write_is_one_graph_without_host_sync():
    """Dynamo traces bind + record (encode + index_copy_) as one graph (fullgraph) with no host-sync op in it: what
    a CUDA-graph capture needs. Run without TORCHDYNAMO_DISABLE in a subprocess (eager backend, no compilation)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    assert line[0] == "RESULT True [] ['item']"
