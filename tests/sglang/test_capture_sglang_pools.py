"""The slot capture on SGLang 0.5.10's own memory classes, stepped as its scheduler steps them: ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, ``MHATokenToKVPoolFP4`` (``set_kv_buffer`` with SGLang's KVFP4 quantizer), ``RadixCache``
and ``Req`` (init_next_round_input + inc_lock_ref, alloc_token_slots (evicts), write_cache_indices' CPU path,
cache_unfinished_req, cache_finished_req + req_to_token_pool.free, Scheduler.flush_cache).

Invariant: every row the read-out delivers as valid is the row written for that token of that sequence under the
current weights (rows here are a function of (token prefix, weight version), as a causal model's); a row that is not
(evicted, slot reused, a flush after a weight update) is not delivered. ``radix_cache`` imports ``sgl_kernel`` only
for HiCache's host-tier transfer kernels (``memory_pool_host``): without sgl_kernel those names raise if called."""

import functools
import importlib.util
import sys
import types
import zlib

import pytest
import torch

from megatron_trace.formats import nvfp4, sglang_kvfp4
from megatron_trace.rollout.sglang.capture import (
    INFO_KEY,
    READOUT_PREFIX,
    active_capture,
    make_attention_hook,
    make_logits_hook,
    set_capture,
)
from megatron_trace.rollout.sglang.records import SiteSpec, encode_rows

from ._common import needs_sglang

pytestmark = needs_sglang

H, HEADS, HD = 32, 2, 32
SPECS = [SiteSpec(0, "expert_fc1_in", (H,)), SiteSpec(0, "kv_k", (HEADS, HD), fmt=sglang_kvfp4.NAME, compact=False),
         SiteSpec(0, "kv_v", (HEADS, HD), fmt=sglang_kvfp4.NAME)]
HOOK_CONFIG = {"specs": [dict(layer=s.layer, site=s.site, row_shape=list(s.row_shape), fmt=s.fmt, compact=s.compact)
                         for s in SPECS]}
PROMPT = [5, 6, 7, 8, 9, 10]
HICACHE_KERNELS = [f"transfer_kv_{n}" for n in (
    "all_layer", "all_layer_direct_lf_pf", "all_layer_lf_pf", "all_layer_lf_ph", "all_layer_mla",
    "all_layer_mla_lf_pf", "direct", "per_layer", "per_layer_direct_pf_lf", "per_layer_mla", "per_layer_mla_pf_lf",
    "per_layer_pf_lf", "per_layer_ph_lf")]


@pytest.fixture(scope="module")
def sgl():
    """SGLang's memory classes (``sgl_kernel.kvcacheio`` stood in for while they import, where it is absent)."""
    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("sgl_kernel") is None:
            pkg, kvio = types.ModuleType("sgl_kernel"), types.ModuleType("sgl_kernel.kvcacheio")

            def absent(*args, **kwargs):
                raise RuntimeError("sgl_kernel is not installed: HiCache's host-tier transfer kernels are absent")

            for name in HICACHE_KERNELS:
                setattr(kvio, name, absent)
            pkg.kvcacheio = kvio
            mp.setitem(sys.modules, "sgl_kernel", pkg)
            mp.setitem(sys.modules, "sgl_kernel.kvcacheio", kvio)
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.common import alloc_token_slots
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams
    yield types.SimpleNamespace(Req=Req, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
                                CacheInitParams=CacheInitParams, alloc_token_slots=alloc_token_slots,
                                MHATokenToKVPoolFP4=MHATokenToKVPoolFP4, ReqToTokenPool=ReqToTokenPool,
                                RadixCache=RadixCache, SamplingParams=SamplingParams)
    set_capture(None)


def _x(prefix, version, what, shape):
    g = torch.Generator().manual_seed(zlib.crc32(repr((tuple(prefix), version, what)).encode()))
    return torch.randn(*shape, generator=g)


@functools.cache
def want_rows(prefix: tuple[int, ...], version: int) -> dict[str, torch.Tensor]:
    """The rows (wire key -> uint8 [nbytes]) of the last token of ``prefix`` under weights ``version`` (causal)."""
    from sglang.srt.layers.quantization.kvfp4_tensor import KVFP4QuantizeUtil

    x = _x(prefix, version, "x", (1, H))
    out = {SPECS[0].wire_key: encode_rows(nvfp4.quantize(x, per_row=True), SPECS[0])[0]}
    for spec, what in ((SPECS[1], "k"), (SPECS[2], "v")):
        codes, sf = KVFP4QuantizeUtil.batched_quantize(_x(prefix, version, what, (1, HEADS, HD)).bfloat16())
        q = sglang_kvfp4.from_sglang(codes.view(torch.uint8), sf.view(torch.uint8))
        out[spec.wire_key] = encode_rows(q, spec)[0]
    return out


class Scheduler:
    """SGLang's scheduler steps on its real pools (page_size 1, as ``trace_server_args`` requires)."""

    def __init__(self, sgl, slots: int):
        set_capture(None)
        self.sgl, fp4 = sgl, torch.float4_e2m1fn_x2
        self.r2t = sgl.ReqToTokenPool(16, 64, "cpu", False)
        self.kv = sgl.MHATokenToKVPoolFP4(slots, 1, fp4, HEADS, HD, 1, "cpu", False)
        self.alloc = sgl.TokenToKVPoolAllocator(slots, fp4, "cpu", self.kv, False)
        self.tree = sgl.RadixCache(sgl.CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                                       token_to_kv_pool_allocator=self.alloc, page_size=1))
        self.attn, self.logits = make_attention_hook(HOOK_CONFIG), make_logits_hook(HOOK_CONFIG)
        self.version, self.n = 0, 0

    def _forward(self, reqs, positions, extend, prefix_lens, loc):
        seqs = [r.origin_input_ids + r.output_ids for r in reqs]
        pre = [s[: p + 1] for s, ps in zip(seqs, positions) for p in ps]
        x = torch.cat([_x(t, self.version, "x", (1, H)) for t in pre])
        k, v = (torch.cat([_x(t, self.version, w, (1, HEADS, HD)) for t in pre]).bfloat16() for w in "kv")
        self.kv.set_kv_buffer(types.SimpleNamespace(layer_id=0), loc, k, v)  # RadixAttention's K/V store
        fb = types.SimpleNamespace(out_cache_loc=loc, token_to_kv_pool=self.kv, rids=[r.rid for r in reqs],
                                   forward_mode=types.SimpleNamespace(is_extend=lambda: extend),
                                   req_to_token_pool=self.r2t, extend_prefix_lens_cpu=prefix_lens,
                                   req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]))
        self.attn(None, (None, k, v, fb), None)
        active_capture().record(0, "expert_fc1_in", nvfp4.quantize(x, per_row=True))
        out = types.SimpleNamespace(customized_info=None)
        self.logits(None, (None, x, None, fb), out)
        return out.customized_info

    def prefill(self, reqs, next_tokens, chunk=None) -> dict:
        """get_new_batch_prefill + prepare_for_extend + process_batch_result_prefill: rid -> read-out payload."""
        for r in reqs:
            if not r.is_chunked:
                r.init_next_round_input(self.tree)
                self.tree.inc_lock_ref(r.last_node)  # PrefillAdder.add_one_req
        prefix = [len(r.prefix_indices) for r in reqs]
        full = [len(r.origin_input_ids + r.output_ids) for r in reqs]
        ends = [f if chunk is None else min(f, p + chunk) for p, f in zip(prefix, full)]
        self.r2t.alloc(reqs)
        loc = self.sgl.alloc_token_slots(self.tree, sum(e - p for p, e in zip(prefix, ends)))
        pt = 0
        for r, p, e, f in zip(reqs, prefix, ends, full):  # write_cache_indices (CPU path)
            self.r2t.write((r.req_pool_idx, slice(0, p)), r.prefix_indices)
            self.r2t.write((r.req_pool_idx, slice(p, e)), loc[pt: pt + e - p])
            pt += e - p
            r.kv_committed_len = r.kv_allocated_len = e
            r.is_chunked, r.fill_ids = int(e < f), (r.origin_input_ids + r.output_ids)[:e]
        info = self._forward(reqs, [list(range(p, e)) for p, e in zip(prefix, ends)], True, prefix, loc)
        payloads = {}
        for i, (r, t) in enumerate(zip(reqs, next_tokens)):
            if r.is_chunked:
                self.tree.cache_unfinished_req(r, chunked=True)
                continue
            r.output_ids.append(t)
            if info is not None and info[INFO_KEY][i] is not None:
                payloads[r.rid] = info[INFO_KEY][i]
            self._release(r) if len(r.output_ids) >= r.sampling_params.max_new_tokens else \
                self.tree.cache_unfinished_req(r)
        return payloads

    def decode(self, reqs, next_tokens) -> None:
        loc = self.sgl.alloc_token_slots(self.tree, len(reqs))
        positions = [len(r.origin_input_ids) + len(r.output_ids) - 1 for r in reqs]
        for r, p, slot in zip(reqs, positions, loc):
            self.r2t.write((r.req_pool_idx, p), slot.to(torch.int32))
            r.kv_committed_len += 1
            r.kv_allocated_len += 1
        self._forward(reqs, [[p] for p in positions], False, [0] * len(reqs), loc)
        for r, t in zip(reqs, next_tokens):
            r.output_ids.append(t)
            if len(r.output_ids) >= r.sampling_params.max_new_tokens:
                self._release(r)

    def _release(self, r) -> None:  # release_kv_cache (no speculative over-allocation)
        self.tree.cache_finished_req(r)
        self.r2t.free(r)

    def flush(self) -> None:  # Scheduler.flush_cache on an idle engine
        self.tree.reset()
        self.r2t.clear()
        self.alloc.clear()

    def request(self, ids, max_new, rid=None):
        self.n += 1
        return self.sgl.Req(rid or f"r{self.n}", "", list(ids), self.sgl.SamplingParams(max_new_tokens=max_new))

    def generate(self, prompts, responses, together=True) -> list[list[int]]:
        reqs = [self.request(p, len(r)) for p, r in zip(prompts, responses)]
        for batch in ([reqs] if together else [[q] for q in reqs]):
            self.prefill(batch, [responses[reqs.index(q)][0] for q in batch])
        while live := [(q, r) for q, r in zip(reqs, responses) if len(q.output_ids) < len(r)]:
            self.decode([q for q, _ in live], [r[len(q.output_ids)] for q, r in live])
        return [p + r for p, r in zip(prompts, responses)]

    def read_out(self, seqs, chunk=None) -> list[dict]:
        """The backend's read-out requests (prompt + response, max_new_tokens=1): one payload each."""
        reqs = [self.request(s, 1, rid=f"{READOUT_PREFIX}t-{i}") for i, s in enumerate(seqs)]
        got = {}
        while pending := [r for r in reqs if not r.output_ids]:
            got.update(self.prefill(pending, [0] * len(pending), chunk=chunk))
        return [got[r.rid] for r in reqs]


def delivered(sched: Scheduler, seqs, payloads) -> list[int]:
    """The rows delivered per sequence, each checked against its token's rows under the current weights."""
    for seq, pay in zip(seqs, payloads):
        assert pay["start"] == 0 and pay["n"] <= len(seq) - 1
        for spec in SPECS:
            rows = torch.frombuffer(bytearray(pay["sites"][spec.wire_key]) or bytearray(1), dtype=torch.uint8)
            rows = rows[: pay["n"] * spec.nbytes].reshape(pay["n"], spec.nbytes)
            for p in range(pay["n"]):
                want = want_rows(tuple(seq[: p + 1]), sched.version)[spec.wire_key]
                assert torch.equal(rows[p], want), (seq, p, spec.key)
    return [p["n"] for p in payloads]


RESPONSES = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [11, 12, 99]]


@pytest.mark.parametrize("together", [True, False], ids=["one-prefill-batch", "staggered-prefix-hits"])
def test_a_grpo_group_reads_out_every_forwarded_position_as_its_own_rows(sgl, together):
    """Four samples of one prompt finishing at different steps: in one prefill batch (the duplicates of the prompt
    freed at finish, the tree keeping the first's slots) or one by one (later samples hit the cached prompt)."""
    s = Scheduler(sgl, slots=64)
    seqs = s.generate([PROMPT] * 4, RESPONSES, together=together)
    assert delivered(s, seqs, s.read_out(seqs)) == [len(q) - 1 for q in seqs]


def test_a_finished_sequence_evicted_and_its_slots_reused_is_not_read_out(sgl):
    """Other work evicts the finished sequence and writes its rows into the freed slots: nothing of them is read out
    (the radix tree no longer reaches them), rather than the other tokens' rows."""
    s = Scheduler(sgl, slots=16)
    (seq,) = s.generate([PROMPT], [[11, 12, 13]])
    s.generate([[40, 41, 42, 43, 44, 45, 46, 47]], [[1, 2, 3, 4, 5, 6, 7]])
    assert s.tree.total_size() == 14 and s.alloc.available_size() == 2  # the other sequence took the 8 slots
    assert delivered(s, [seq], s.read_out([seq])) == [0]


def test_a_read_out_that_needs_eviction_keeps_its_own_locked_prefix(sgl):
    """A read-out batch whose cold member needs slots evicts others, never the matched prefix of a read-out."""
    s = Scheduler(sgl, slots=30)
    (seq,) = s.generate([PROMPT], [[11, 12, 13]])
    s.generate([[300, 301, 302, 303, 304, 305]], [[1, 2, 3, 4]])
    cold = [400 + i for i in range(12)]
    assert delivered(s, [seq, cold], s.read_out([seq, cold])) == [8, 0]


def test_after_a_weight_update_and_its_flush_nothing_of_the_old_weights_is_read_out(sgl):
    s = Scheduler(sgl, slots=64)
    seqs = s.generate([PROMPT] * 2, [[11, 12], [21, 22]])
    s.version += 1
    s.flush()  # update_weights_from_tensor / _distributed with flush_cache=True (the backend's)
    assert delivered(s, seqs, s.read_out(seqs)) == [0, 0]


def test_chunked_prefills_sharing_a_prefix_read_out_their_own_rows(sgl):
    """A long prompt prefilled in chunks of 8 (cache_unfinished_req after each), a second request hitting its first
    chunk in between; then an evicted sequence read out in chunks (only the last chunk's payload is collected: its
    prefix includes the rows the read-out recomputed)."""
    s = Scheduler(sgl, slots=80)
    long = list(range(100, 120))
    a, b = s.request(long, 2), s.request(long[:12] + [7, 7], 2)
    s.prefill([a], [0], chunk=8)
    s.prefill([b], [50])
    s.prefill([a], [60], chunk=8)
    s.prefill([a], [61], chunk=8)
    s.decode([a, b], [62, 51])
    seqs = [long + [61, 62], long[:12] + [7, 7, 50, 51]]
    assert delivered(s, seqs, s.read_out(seqs)) == [21, 15]
    s = Scheduler(sgl, slots=40)
    (seq,) = s.generate([long], [[61, 62]])
    s.generate([[200 + i for i in range(20)]], [[1, 2, 3]])
    assert delivered(s, [seq], s.read_out([seq], chunk=8)) == [16]
