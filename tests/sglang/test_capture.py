"""Slot capture end to end on CPU: the real hooks, the real TRACE MoE method and SGLang's own KV quantizer,
with SGLang's scheduler bookkeeping (slot allocator, req_to_token, radix prefix match, FP4 KV pool) simulated
by ``MiniEngine`` on real tensors (SGLang's radix cache imports sgl_kernel through ``memory_pool_host``;
test_capture_sglang_pools.py drives SGLang's own pools, radix cache and Req with it stood in for).

Issue 11 item 6: a radix-cache prefix hit gives the same records as a cold run, bit for bit."""

import types

import pytest
import torch

from megatron_trace.rollout.sglang.capture import (
    INFO_KEY,
    READOUT_PREFIX,
    make_attention_hook,
    make_logits_hook,
    set_capture,
)
from megatron_trace.rollout.sglang.records import SiteSpec, assemble

from ._common import K_TOP, E, F, H, needs_sglang
from .test_quant import _ckpt_state, _load_like_fused_moe, _moe_layer

pytestmark = needs_sglang

HEADS, HD, SLOTS = 2, 32, 64
SPECS = [SiteSpec(0, "expert_fc1_in", (H,), compact=True), SiteSpec(0, "expert_fc2_in", (K_TOP, F), compact=False),
         SiteSpec(0, "kv_k", (HEADS, HD), fmt="sglang_kvfp4", compact=False),
         SiteSpec(0, "kv_v", (HEADS, HD), fmt="sglang_kvfp4", compact=True)]
HOOK_CONFIG = {"specs": [dict(layer=s.layer, site=s.site, row_shape=list(s.row_shape), fmt=s.fmt, compact=s.compact)
                         for s in SPECS]}
_G = torch.Generator().manual_seed(7)
EMB = torch.randn(64, H, generator=_G)
WK, WV, WR = (torch.randn(H, HEADS * HD, generator=_G), torch.randn(H, HEADS * HD, generator=_G),
              torch.randn(H, E, generator=_G))


def hidden_of(seq: list[int], positions: list[int]) -> torch.Tensor:
    """A causal toy: position p's hidden depends on tokens[:p+1] only (as a real model's does)."""
    return torch.stack([EMB[seq[p]] + 0.5 * EMB[seq[p - 1]] * (p > 0) + 0.01 * p for p in positions]).bfloat16()


def routing_of(hidden: torch.Tensor) -> torch.Tensor:
    return (hidden.float() @ WR).topk(K_TOP, dim=-1).indices  # [T, topk]


class MiniEngine:
    """SGLang's bookkeeping on real tensors: slots 1.. (0 = dummy), req_to_token int32 [reqs, ctx], a radix map of
    token prefixes to slots (with ``radix=True``), and an FP4 KV pool laid out as ``MHATokenToKVPoolFP4`` and
    written as its ``set_kv_buffer`` does, with SGLang's ``KVFP4QuantizeUtil.batched_quantize``."""

    def __init__(self, method, layer, hook_config=HOOK_CONFIG):
        self.method, self.layer = method, layer
        self.free = list(range(1, SLOTS))
        self.req_to_token = torch.zeros(16, 32, dtype=torch.int32)
        self.next_req = 0
        self.radix: dict[tuple[int, ...], list[int]] = {}
        u8 = lambda *s: [torch.zeros(*s, dtype=torch.uint8)]  # noqa: E731
        self.pool = types.SimpleNamespace(k_buffer=u8(SLOTS, HEADS, HD // 2), v_buffer=u8(SLOTS, HEADS, HD // 2),
                                          k_scale_buffer=u8(SLOTS, HEADS * HD // 16),
                                          v_scale_buffer=u8(SLOTS, HEADS * HD // 16),
                                          start_layer=0, size=SLOTS - 1, page_size=1)
        self.attn_hook, self.logits_hook = make_attention_hook(hook_config), make_logits_hook(hook_config)
        self.forward_tokens: list[int] = []

    def admit(self, seq: list[int]) -> tuple[int, int]:
        """A new request: (req_pool_idx, cached prefix length), req_to_token filled with the matched slots."""
        idx, self.next_req = self.next_req, self.next_req + 1
        n = next((k for k in range(len(seq) - 1, 0, -1) if tuple(seq[:k]) in self.radix), 0)
        if n:
            self.req_to_token[idx, :n] = torch.tensor(self.radix[tuple(seq[:n])], dtype=torch.int32)
        return idx, n

    def forward(self, batch: list[tuple[int, list[int], list[int]]], rids=None, extend=True):
        """batch: (req_pool_idx, sequence, positions computed now). Allocates slots, runs attention + MoE."""
        loc, hidden, ids = [], [], []
        for idx, seq, pos in batch:
            slots = [self.free.pop(0) for _ in pos]
            self.req_to_token[idx, pos[0] : pos[-1] + 1] = torch.tensor(slots, dtype=torch.int32)
            loc += slots
            hidden.append(hidden_of(seq, pos))
        loc, hidden = torch.tensor(loc), torch.cat(hidden)
        self.forward_tokens.append(len(loc))
        fb = types.SimpleNamespace(out_cache_loc=loc, token_to_kv_pool=self.pool, rids=rids,
                                   forward_mode=types.SimpleNamespace(is_extend=lambda: extend),
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=self.req_to_token),
                                   req_pool_indices=torch.tensor([b[0] for b in batch]),
                                   extend_prefix_lens_cpu=[b[2][0] for b in batch])
        from sglang.srt.layers.quantization.kvfp4_tensor import KVFP4QuantizeUtil

        k = (hidden.float() @ WK).reshape(-1, HEADS, HD).bfloat16()
        v = (hidden.float() @ WV).reshape(-1, HEADS, HD).bfloat16()
        for buf, sbuf, t in ((self.pool.k_buffer, self.pool.k_scale_buffer, k),
                             (self.pool.v_buffer, self.pool.v_scale_buffer, v)):
            packed, sf = KVFP4QuantizeUtil.batched_quantize(t)  # what MHATokenToKVPoolFP4.set_kv_buffer stores
            buf[0][loc], sbuf[0][loc] = packed, sf
        self.attn_hook(None, (None, k, v, fb), None)  # RadixAttention(q, k, v, forward_batch)
        ids = routing_of(hidden)
        self.method.emulated_forward(self.layer, hidden, ids.int(), torch.full(ids.shape, 0.5))
        out = types.SimpleNamespace(customized_info=None)
        self.logits_hook(None, (None, hidden, None, fb), out)  # logits_processor(ids, hidden, lm_head, fb)
        return out.customized_info

    def cache(self, seq: list[int], idx: int, n: int) -> None:
        """cache_unfinished_req / cache_finished_req: the first n tokens' slots become a radix entry."""
        for k in range(1, n + 1):
            self.radix[tuple(seq[:k])] = self.req_to_token[idx, :k].tolist()

    def read_out(self, seqs: list[list[int]]) -> list[list[dict]]:
        """The backend's read-out: each finished sequence again, one extend token, marked READOUT_PREFIX."""
        batch, rids = [], []
        for i, seq in enumerate(seqs):
            idx, n = self.admit(seq)
            batch.append((idx, seq, list(range(n, len(seq)))))
            rids.append(f"{READOUT_PREFIX}t-{i}")
        info = self.forward(batch, rids=rids)
        return [[p] for p in info[INFO_KEY]]


@pytest.fixture
def engine_factory():
    from megatron_trace.rollout.sglang.launch import register

    register()
    from megatron_trace.rollout.sglang import quant

    state, qcfg = _ckpt_state()

    def make(hook_config=HOOK_CONFIG):
        set_capture(None)
        method, layer = _moe_layer(quant, qcfg)
        _load_like_fused_moe(quant, layer, state)
        return MiniEngine(method, layer, hook_config)

    yield make
    set_capture(None)


PROMPT, RESP_A, RESP_B = [3, 1, 4, 1, 5, 9], [11, 12, 13], [21, 22, 23]


def _grpo_with_prefix_hit(eng: MiniEngine) -> list[list[dict]]:
    """A prefilled cold; B (same prompt) arrives later and hits A's cached prompt; both decode 2 tokens."""
    a, b = PROMPT + RESP_A, PROMPT + RESP_B
    ia, _ = eng.admit(a[:6])
    eng.forward([(ia, a, list(range(6)))])
    eng.cache(a, ia, 6)
    ib, nb = eng.admit(b[:6])
    assert nb == 5  # SGLang matches at most len - 1 tokens: B extends its last prompt token only
    eng.forward([(ib, b, [5])])
    for p in (6, 7):  # decode: position 8 is sampled last and never forwarded
        eng.forward([(ia, a, [p]), (ib, b, [p])], extend=False)
    eng.cache(a, ia, 8)
    eng.cache(b, ib, 8)
    return eng.read_out([a, b])


def _cold(eng: MiniEngine, seq: list[int]) -> list[list[dict]]:
    i, n = eng.admit(seq[:6])
    assert n == 0
    eng.forward([(i, seq, list(range(6)))])
    for p in (6, 7):
        eng.forward([(i, seq, [p])], extend=False)
    eng.cache(seq, i, 8)
    return eng.read_out([seq])


def _guidance(payloads, seqs):
    routing = {0: torch.stack([torch.cat([routing_of(hidden_of(s, list(range(len(s))))), torch.zeros(0, K_TOP)])
                               for s in seqs]).long()}
    return assemble(payloads, SPECS, seq_len=9, routing=routing)


def _same(x, y):
    for k in x:
        rx, ry = x[k].record, y[k].record
        payload = "mantissa_bits" if hasattr(rx, "mantissa_bits") else "codes"
        assert torch.equal(getattr(rx, payload), getattr(ry, payload)), k
        assert torch.equal(rx.block_scales.view(torch.uint8), ry.block_scales.view(torch.uint8)), k
        assert (rx.global_amax is None) == (ry.global_amax is None), k
        assert rx.global_amax is None or torch.equal(rx.global_amax, ry.global_amax), k
        assert torch.equal(x[k].valid, y[k].valid), k


def test_prefix_hit_records_equal_cold_records(engine_factory):
    hot = engine_factory()
    g_hot = _guidance(_grpo_with_prefix_hit(hot), [PROMPT + RESP_A, PROMPT + RESP_B])
    assert hot.forward_tokens[1] == 1  # B's prompt was not recomputed
    assert hot.forward_tokens[-1] == 2  # the read-out extends one token per sequence
    cold = engine_factory()
    g_cold_b = _guidance(_cold(cold, PROMPT + RESP_B), [PROMPT + RESP_B])
    g_hot_b = {k: _row(v, 1) for k, v in g_hot.items()}
    _same(g_hot_b, g_cold_b)
    for k, sg in g_hot.items():  # every forwarded position is valid; the last sampled token never is
        valid = sg.valid if sg.valid.dim() == 2 else sg.valid[..., 0]
        assert valid.tolist() == [[True] * 8 + [False]] * 2, k


def test_records_are_what_the_kv_store_and_the_method_produced(engine_factory):
    from sglang.srt.layers.quantization.kvfp4_tensor import KVFP4QuantizeUtil

    from megatron_trace.formats import nvfp4

    eng = engine_factory()
    seq = PROMPT + RESP_A
    g = _guidance(_cold(eng, seq), [seq])
    hidden = hidden_of(seq, list(range(8)))
    k = (hidden.float() @ WK).reshape(-1, HEADS, HD).bfloat16()
    packed, sf = KVFP4QuantizeUtil.batched_quantize(k)
    kv_k = g[(0, "kv_k")].record
    assert kv_k.fmt == "sglang_kvfp4" and kv_k.global_amax is None and kv_k.shape == (1, 9, HEADS, HD)
    assert torch.equal(kv_k.codes[0, :8], packed)
    assert torch.equal(kv_k.block_scales[0, :8].view(torch.uint8).reshape(8, -1), sf)
    fc1 = g[(0, "expert_fc1_in")].record  # the emulated method's per-row RNE NVFP4 of the MoE input
    want = nvfp4.quantize(hidden, per_row=True).guidance(compact=True)
    assert torch.equal(fc1.mantissa_bits[0, :8], want.mantissa_bits)
    assert torch.equal(fc1.global_amax[0, :8], want.global_amax)


def test_evicted_prefix_rows_are_missing_not_wrong(engine_factory):
    eng = engine_factory()
    seq = PROMPT + RESP_A
    i, _ = eng.admit(seq[:6])
    eng.forward([(i, seq, list(range(6)))])
    for p in (6, 7):
        eng.forward([(i, seq, [p])], extend=False)
    eng.cache(seq, i, 8)
    for key in [k for k in eng.radix if len(k) > 4]:
        del eng.radix[key]  # eviction of the tail: only 4 tokens stay cached
    g = _guidance(eng.read_out([seq]), [seq])
    ref = _guidance(_cold(engine_factory(), seq), [seq])
    fc1 = g[(0, "expert_fc1_in")]
    assert fc1.valid[0].tolist() == [True] * 4 + [False] * 5  # recomputed positions are not delivered
    assert torch.equal(fc1.record.mantissa_bits[0, :4], ref[(0, "expert_fc1_in")].record.mantissa_bits[0, :4])


def test_a_read_out_batch_takes_each_request_s_own_cached_prefix(engine_factory):
    """Two read-outs in one extend forward whose cached prefixes differ (8 and 4 positions): each request's rows
    are its own prefix's (by its req_pool_idx and extend_prefix_len), as when read out alone."""
    eng = engine_factory()
    a, c = PROMPT + RESP_A, [2, 7, 1, 8, 2, 8, 41, 42, 43]
    for seq in (a, c):
        i, _ = eng.admit(seq[:6])
        eng.forward([(i, seq, list(range(6)))])
        for p in (6, 7):
            eng.forward([(i, seq, [p])], extend=False)
        eng.cache(seq, i, 8)
    for key in [k for k in eng.radix if k[0] == c[0] and len(k) > 4]:
        del eng.radix[key]  # c keeps 4 cached positions, a all 8
    payloads = eng.read_out([a, c])
    assert [p[0]["n"] for p in payloads] == [8, 4]
    got = _guidance(payloads, [a, c])
    for k, sg in got.items():
        valid = sg.valid if sg.valid.dim() == 2 else sg.valid[..., 0]
        assert valid.tolist() == [[True] * 8 + [False], [True] * 4 + [False] * 5], k
    _same({k: _row(v, 0) for k, v in got.items()}, _guidance(_cold(engine_factory(), a), [a]))
    ref_c = _guidance(_cold(engine_factory(), c), [c])
    for k, sg in got.items():  # c's 4 delivered positions are c's rows
        payload = "mantissa_bits" if hasattr(sg.record, "mantissa_bits") else "codes"
        assert torch.equal(getattr(sg.record, payload)[1, :4], getattr(ref_c[k].record, payload)[0, :4]), k


def test_kv_rows_index_the_pool_from_its_start_layer():
    """A pool holding layers 2..3 (pipeline stage, ``start_layer=2``) stores layer 3 at index 1."""
    from megatron_trace.rollout.sglang.capture import kv_rows

    g = torch.Generator().manual_seed(3)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    codes, scales = [u8(8, HEADS, HD // 2), u8(8, HEADS, HD // 2)], [u8(8, HEADS * HD // 16) for _ in range(2)]
    staged = types.SimpleNamespace(k_buffer=codes, v_buffer=codes, k_scale_buffer=scales, v_scale_buffer=scales,
                                   start_layer=2)
    slots = torch.tensor([5, 1, 2])
    for stage_layer in (0, 1):
        alone = types.SimpleNamespace(k_buffer=codes[stage_layer:], v_buffer=codes[stage_layer:],
                                      k_scale_buffer=scales[stage_layer:], v_scale_buffer=scales[stage_layer:])
        got = kv_rows(staged, SiteSpec(2 + stage_layer, "kv_k", (HEADS, HD), fmt="sglang_kvfp4", compact=False), slots)
        want = kv_rows(alone, SiteSpec(0, "kv_k", (HEADS, HD), fmt="sglang_kvfp4", compact=False), slots)
        assert torch.equal(got, want), stage_layer
        assert torch.equal(got[:, : HEADS * HD // 2], codes[stage_layer][slots].reshape(3, -1))  # full: codes first


def _row(sg, i):
    import dataclasses

    r = sg.record
    payload = "mantissa_bits" if hasattr(r, "mantissa_bits") else "codes"
    amax = None if r.global_amax is None else r.global_amax[i : i + 1]
    rec = dataclasses.replace(r, block_scales=r.block_scales[i : i + 1], global_amax=amax,
                              shape=(1, *r.shape[1:]), **{payload: getattr(r, payload)[i : i + 1]})
    ids = None if sg.expert_ids is None else sg.expert_ids[i : i + 1]
    return type(sg)(rec, sg.valid[i : i + 1], ids)


class MiniSGLangEngine:
    """Test-only stand-in for ``sglang.Engine.generate`` over ``MiniEngine``: generation requests run prefill (radix
    matched) and decode with fixed responses; ``rid``-marked read-out requests return ``meta_info[INFO_KEY]``."""

    def __init__(self, eng: MiniEngine, responses: list[list[int]]):
        self.eng, self.responses, self.calls = eng, responses, []

    def generate(self, input_ids, sampling_params, rid=None, return_logprob=False, return_routed_experts=False):
        self.calls.append((input_ids, sampling_params, rid))
        if rid is not None:
            return [{"meta_info": {INFO_KEY: p}} for p in self.eng.read_out(input_ids)]
        import base64

        outs = []
        for prompt, resp in zip(input_ids, self.responses):  # one request at a time, like arrivals in order
            seq = prompt + resp
            i, n = self.eng.admit(seq[: len(prompt)])
            self.eng.forward([(i, seq, list(range(n, len(prompt))))])
            self.eng.cache(seq, i, len(prompt))
            for p in range(len(prompt), len(seq) - 1):
                self.eng.forward([(i, seq, [p])], extend=False)
            self.eng.cache(seq, i, len(seq) - 1)
            r = routing_of(hidden_of(seq, list(range(len(seq) - 1)))).int()  # [seqlen-1, topk], one layer
            outs.append({"output_ids": resp, "meta_info": {
                "output_token_logprobs": [(0.0, t, None) for t in resp], "finish_reason": {"type": "length"},
                "routed_experts": base64.b64encode(r.numpy().tobytes()).decode()}})
        return outs


def test_backend_generate_reads_out_prefix_hits_like_cold(engine_factory):
    from megatron_trace.config import TraceConfig
    from megatron_trace.rollout.base import SamplingParams
    from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend
    from megatron_trace.rollout.sglang.launch import trace_server_args

    hf = {"num_hidden_layers": 1, "vocab_size": 64, "hidden_size": H, "moe_intermediate_size": F,
          "num_experts_per_tok": K_TOP, "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": HD,
          "num_experts": E}
    cfg = TraceConfig(guided_layers="all", cache_mode="full")
    prompts, resp = [PROMPT, PROMPT], [RESP_A, RESP_B]
    hooks = trace_server_args("/ckpt", cfg, hf)["forward_hooks"]  # what the engine's scheduler would register
    assert hooks[0]["config"] == hooks[1]["config"]
    hot = MiniSGLangEngine(engine_factory(hooks[0]["config"]), resp)
    be = SGLangRolloutBackend(hot, cfg, hf, accept_kv_format_mismatch=True)
    batch = be.generate(prompts, SamplingParams(max_new_tokens=3))
    (_, params, rids) = hot.calls[1]
    assert all(r.startswith(READOUT_PREFIX) for r in rids) and params[0]["max_new_tokens"] == 1
    assert set(batch.guidance) == {(0, "expert_fc1_in"), (0, "expert_fc2_in"), (0, "kv_k"), (0, "kv_v")}
    assert {k[1]: v.record.fmt for k, v in batch.guidance.items()} == {
        "expert_fc1_in": "nvfp4", "expert_fc2_in": "nvfp4", "kv_k": "sglang_kvfp4", "kv_v": "sglang_kvfp4"}
    cold = MiniSGLangEngine(engine_factory(hooks[0]["config"]), [RESP_B])
    cold_batch = SGLangRolloutBackend(cold, cfg, hf, accept_kv_format_mismatch=True).generate(
        [PROMPT], SamplingParams(max_new_tokens=3))
    _same({k: _row(v, 1) for k, v in batch.guidance.items()}, cold_batch.guidance)
    assert batch.guidance[(0, "expert_fc1_in")].valid.tolist() == [[True] * 8 + [False]] * 2


def test_backend_kv_records_guide_a_trainer_in_sglangs_kv_format(engine_factory):
    """kv_format='sglang_kvfp4': the backend accepts the trainer's recipe without accept_kv_format_mismatch, and
    the KV records it reads out (SGLang's own quantizer's pool rows) are what the trainer's KV quantizer, guided
    by them, computes on the same K/V: every code and scale."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.manifest import QuantRecipe
    from megatron_trace.rollout.base import SamplingParams
    from megatron_trace.rollout.sglang.backend import SGLangRolloutBackend
    from megatron_trace.rollout.sglang.launch import trace_server_args

    hf = {"num_hidden_layers": 1, "vocab_size": 64, "hidden_size": H, "moe_intermediate_size": F,
          "num_experts_per_tok": K_TOP, "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": HD,
          "num_experts": E, "dtype": "bfloat16"}  # (an exported config.json: SGLang's "auto" serves bf16)
    cfg = TraceConfig(guided_layers="all", cache_mode="full", kv_format="sglang_kvfp4")
    hooks = trace_server_args("/ckpt", cfg, hf)["forward_hooks"]
    eng = MiniSGLangEngine(engine_factory(hooks[0]["config"]), [RESP_A])
    modules = ("model.layers.0.mlp.experts", "model.layers.0.self_attn.kv_cache")
    recipe = QuantRecipe.from_config(cfg, guided_layers=(0,), quantized_modules=modules)
    be = SGLangRolloutBackend(eng, cfg, hf, recipe=recipe)
    batch = be.generate([PROMPT], SamplingParams(max_new_tokens=3))
    hidden = hidden_of(PROMPT + RESP_A, list(range(8)))
    q = cfg.kv_quantizer()
    for site, w in (("kv_k", WK), ("kv_v", WV)):
        sg = batch.guidance[(0, site)]
        assert sg.record.fmt == q.fmt and sg.valid[0].tolist() == [True] * 8 + [False]
        x = (hidden.float() @ w).reshape(1, 8, HEADS, HD).bfloat16()  # the trainer's K/V (same numbers here)
        rec = _row(sg, 0).record
        rec = type(rec)(codes=rec.codes[:, :8], block_scales=rec.block_scales[:, :8], global_amax=None,
                        shape=(1, 8, HEADS, HD), fmt=rec.fmt)
        got = q.guided_quantize(x, rec)
        assert torch.equal(got.codes, rec.codes), site
        assert torch.equal(got.block_scales.view(torch.uint8), rec.block_scales.view(torch.uint8)), site


def _tree(module: str):
    import ast
    import importlib.util
    import os

    root = os.path.dirname(importlib.util.find_spec("sglang").origin)
    return ast.parse(open(os.path.join(root, *module.split(".")[1:]) + ".py").read())


def test_hooks_fit_sglangs_call_sites_and_forward_batch():
    """What the hooks read, checked against SGLang 0.5.10.post1's sources (the modules need CUDA to import)."""
    import ast

    fields = {n.target.id for c in ast.walk(_tree("sglang.srt.model_executor.forward_batch_info"))
              if isinstance(c, ast.ClassDef) and c.name == "ForwardBatch"
              for n in c.body if isinstance(n, ast.AnnAssign)}
    need = {"out_cache_loc", "token_to_kv_pool", "rids", "forward_mode", "req_to_token_pool", "req_pool_indices",
            "extend_prefix_lens_cpu"}
    assert need <= fields, need - fields
    calls = [ast.unparse(n) for n in ast.walk(_tree("sglang.srt.models.qwen3_moe")) if isinstance(n, ast.Call)]
    assert any(c.startswith("self.attn(q, k, v, fb") for c in calls)  # RadixAttention: forward_batch = args[3]
    logits_call = "self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch"
    assert any(c.startswith(logits_call) for c in calls)
    assert any("rids=[req.rid for req in batch.reqs]" in ast.unparse(n)
               for n in ast.walk(_tree("sglang.srt.model_executor.forward_batch_info")) if isinstance(n, ast.Call))
    from ._common import source_signature

    assert "rid" in source_signature("sglang.srt.entrypoints.engine", "Engine.generate")


def test_fc2_records_are_the_method_s_fc2_inputs(engine_factory):
    """The expert_fc2_in rows read out are the emulated MoE's own quantized fc2 inputs (per token and top-k slot)."""
    from megatron_trace.rollout.sglang.capture import active_capture

    eng = engine_factory()
    seq = PROMPT + RESP_A
    g = _guidance(_cold(eng, seq), [seq])
    hidden = hidden_of(seq, list(range(8)))
    ids = routing_of(hidden)
    cap = active_capture()
    set_capture(None)  # the reference forward records nothing
    try:
        want = eng.method.emulated_forward(eng.layer, hidden, ids.int(), torch.full(ids.shape, 0.5)).fc2_in
    finally:
        set_capture(cap)
    fc2 = g[(0, "expert_fc2_in")]
    assert fc2.valid[0, :8].all() and torch.equal(fc2.expert_ids[0, :8], ids)
    assert torch.equal(fc2.record.codes[0, :8], want.codes)
    assert torch.equal(fc2.record.block_scales[0, :8].view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(fc2.record.global_amax[0, :8], want.global_amax.float())
