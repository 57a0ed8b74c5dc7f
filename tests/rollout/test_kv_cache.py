import pytest
import torch
from transformers.cache_utils import Cache, DynamicLayer

from megatron_trace.config import TraceConfig
from megatron_trace.formats import e2m1
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.kv_cache import FP4KVCache
from megatron_trace.rollout.recorder import GuidanceRecorder

from ._tiny import tiny_config, tiny_model

PROMPTS = [[3, 4, 5, 6], [7, 8]]


class FakeQuantKV(DynamicLayer):
    """Independent reference: a plain cache layer that fake-quantizes K/V before storing them."""

    def __init__(self, quantizer):
        super().__init__()
        self.quantizer = quantizer
        self.codes_k = None

    def update(self, key_states, value_states, *args, **kwargs):
        q = self.quantizer.quantize(key_states)
        self.codes_k = q.unpacked_codes()  # [B, heads, S, hd]
        return super().update(q.dequantize(key_states.dtype), self.quantizer.fake_quantize(value_states))


def full_forward_fake_quant_kv(be, batch):
    """One full-sequence forward over the rollout's tokens with fake-quantized K/V -> logprobs, layers."""
    layers = [FakeQuantKV(be.config.kv_quantizer()) for _ in range(be.num_layers)]
    with be.forward_context() as model:
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long(), use_cache=True,
                       **be.cache_kwargs(Cache(layers=layers))).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(batch.batch_size, 1), logp], 1), layers


@pytest.mark.parametrize("sites, kv_format", [
    (("kv_k", "kv_v"), ""), (("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v", "weights"), ""),
    (("expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v", "weights"), "sglang_kvfp4"),
])
def test_fp4_kv_decode_equals_full_forward_with_fake_quantized_kv(sites, kv_format):
    cfg = TraceConfig(sites=sites, guided_sites=("kv_k", "kv_v"), guided_layers="all", cache_mode="full",
                      kv_format=kv_format)
    be = HFRolloutBackend(tiny_model(seed=1), mode="fp4", trace_config=cfg, dtype=torch.float32)
    out = be.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=2))
    ref, layers = full_forward_fake_quant_kv(be, out)
    m = out.response_mask
    assert torch.allclose(out.logprobs[m], ref[m], atol=1e-4)
    # the K codes the cache stored (recorded as kv_k guidance) are those of the fake-quant reference
    rec = out.guidance[(1, "kv_k")]
    assert rec.record.fmt == cfg.kv_record_format and be.recipe().kv_format == cfg.kv_record_format
    got = e2m1.decode(rec.record.unpacked_codes())[rec.valid]  # [N, heads, hd]
    want = e2m1.decode(layers[1].codes_k.transpose(1, 2))[rec.valid]
    assert (got != want).float().mean() < 0.01
    # and the FP4 cache does change the numerics compared with an unquantized rollout
    bf16 = HFRolloutBackend(tiny_model(seed=1), mode="bf16", dtype=torch.float32)
    plain = bf16.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=2))
    same = plain.tokens.shape == out.tokens.shape and torch.equal(plain.tokens, out.tokens)
    assert not same or (plain.logprobs[m] - out.logprobs[m]).abs().max() > 1e-3


def test_cache_stores_packed_fp4_and_counts_bytes():
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(2, q)
    k = torch.randn(2, 3, 5, 32)  # [B, kv_heads, T, head_dim]
    keys, values = cache.update(k, -k, 0)
    assert torch.equal(keys, q.fake_quantize(k)) and keys.shape == k.shape
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert keys.shape == (2, 3, 6, 32) and cache.get_seq_length(0) == 6
    layer = cache.layers[0]
    assert layer.fp4_history("kv_k").codes.dtype == torch.uint8 and layer.fp4_history("kv_v").shape == (2, 3, 6, 32)
    rows = 2 * 3 * 6
    per_row = 32 // 2 + 32 // 16 + 4  # packed codes + E4M3 block scales + fp32 row amax
    assert layer.nbytes() == 2 * rows * per_row
    with pytest.raises(NotImplementedError):
        layer.crop(-1)


def test_unquantized_side_is_kept_in_model_dtype():
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, quantize_k=True, quantize_v=False)
    k = torch.randn(1, 2, 4, 16)
    keys, values = cache.update(k, k, 0)
    assert torch.equal(values, k) and not torch.equal(keys, k)


def test_fused_decode_attention_equals_dequantize_then_sdpa():
    """Decode steps reading the packed FP4 history (rollout.attention; reference math on the CPU) give the
    logprobs of the dequantize-then-SDPA path, left padding included."""
    outs = {}
    for fused in (False, True):
        be = HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, fused_kv_attention=fused)
        assert be.fused_kv_attention is fused
        outs[fused] = be.generate(PROMPTS + [[9, 10, 11]], SamplingParams(max_new_tokens=6, seed=5))
    a, b = outs[False], outs[True]
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_deferred_update_keeps_the_history_packed():
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, fused_decode=True)
    k = torch.randn(2, 3, 5, 32)
    keys, _ = cache.update(k, k, 0)
    assert keys.shape == k.shape  # a prefill still returns the dequantized history
    step, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    layer = step._trace_fp4_kv_layer
    assert step.shape == (2, 3, 1, 32) and layer is cache.layers[0]
    hk, hv = layer.packed_history()
    assert hk.shape == (2, 3, 6, 32) and torch.equal(hk.dequantize(), q.fake_quantize(torch.cat([k, k[:, :, :1]], 2)))


def test_sglang_kv_format_stores_sglangs_rows_without_triton_or_fused_decode():
    """kv_format='sglang_kvfp4': rows are SGLang's compiled quantizer's (float32 math), dequantized on read (a
    decode step returns the whole history: no deferred fused attention), kernel='triton' is not used."""
    from megatron_trace.formats import sglang_kvfp4

    q = TraceConfig(kv_format="sglang_kvfp4").kv_quantizer()
    cache = FP4KVCache(1, q, kernel="triton", fused_decode=True)
    k = (torch.randn(2, 3, 5, 32) * torch.logspace(-2, 2, 32)).bfloat16()  # [B, kv_heads, T, head_dim]
    want = sglang_kvfp4.quantize(k, compute_dtype=torch.float32)
    keys, values = cache.update(k, -k, 0)
    assert torch.equal(keys, sglang_kvfp4.dequantize(want, k.dtype)) and keys.dtype == torch.bfloat16
    hist = cache.layers[0].fp4_history("kv_k")
    assert hist.fmt == "sglang_kvfp4" and hist.global_amax is None and torch.equal(hist.codes, want.codes)
    assert torch.equal(hist.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    step, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert step.shape == (2, 3, 6, 32) and not hasattr(step, "_trace_fp4_kv_layer")
    assert cache.layers[0].nbytes() == 2 * (2 * 3 * 6) * (32 // 2 + 32 // 16)  # codes + E8M0 scales, no amax


def test_hf_backend_never_fuses_sglang_kv_attention():
    cfg = TraceConfig(kv_format="sglang_kvfp4")
    be = HFRolloutBackend(tiny_model(seed=4), mode="fp4", trace_config=cfg, dtype=torch.float32,
                          fused_kv_attention=True)
    assert not be.fused_kv_attention and not be.new_cache().layers[0].fused_decode


@pytest.mark.parametrize("fmt, head_dim", [("mxfp4", 16), ("nvfp4", 8)])
def test_fused_kv_attention_needs_head_dim_a_multiple_of_the_kv_block(fmt, head_dim):
    """A head_dim below the KV block (the cache pads each row to one block, which the fused decode attention does not
    read): fused_kv_attention=True was accepted and every generate raised in its first decode step, as did the CUDA
    default (None); now True is refused by name, None leaves it off and runs the rollout of fused=False."""
    cfg = TraceConfig(format=fmt)
    with pytest.raises(ValueError, match=rf"fused_kv_attention=True: head_dim={head_dim} is not a multiple of the "
                                         rf"{fmt} KV block"):
        HFRolloutBackend(tiny_model(tiny_config(head_dim=head_dim), seed=4), mode="fp4", trace_config=cfg,
                         dtype=torch.float32, fused_kv_attention=True)
    outs = [HFRolloutBackend(tiny_model(tiny_config(head_dim=head_dim), seed=4), mode="fp4", trace_config=cfg,
                             dtype=torch.float32, fused_kv_attention=fused).generate(PROMPTS, SamplingParams(
                                 max_new_tokens=3, seed=0)) for fused in (None, False)]
    assert torch.equal(outs[0].tokens, outs[1].tokens) and torch.equal(outs[0].logprobs, outs[1].logprobs)


def test_generate_reads_each_rows_interval_as_its_mask_would():
    """generate's FP4 cache takes each row's attended interval (left padding, finished rows' tails) instead of
    the mask: the same tokens and log-probs as the mask, bit for bit (reference math on the CPU); no hole."""
    be = HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, fused_kv_attention=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [7, 8], [9, 10, 11], [12]]
    sampling = SamplingParams(max_new_tokens=10, seed=3, stop_token_ids=tuple(range(0, be.vocab_size, 7)))
    new_cache = be.new_cache
    seen = []

    def cache_with(interval_masks):
        def make(recorder=None, **_):
            seen.append(new_cache(recorder, interval_masks=interval_masks))
            return seen[-1]
        return make

    outs = {}
    for intervals in (True, False):
        be.new_cache = cache_with(intervals)
        outs[intervals] = be.generate(prompts, sampling)
    assert seen[0].layers[0].interval_masks and not seen[1].layers[0].interval_masks
    assert seen[0].mask_holes.used and not seen[1].mask_holes.used
    a, b = outs[True], outs[False]
    lengths = a.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows finished at different steps (tails masked)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def test_interval_cache_counts_a_mask_with_a_hole():
    be = HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, fused_kv_attention=True)
    cache = be.new_cache(interval_masks=True)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 1] = 0  # a hole in row 1
    with be.forward_context() as model:
        model(input_ids=ids, attention_mask=mask[:, :4], use_cache=True, **be.cache_kwargs(cache))
        model(input_ids=ids[:, :1], attention_mask=mask, position_ids=torch.tensor([[4], [3]]), use_cache=True,
              **be.cache_kwargs(cache))
    with pytest.raises(ValueError, match="1 decode-step mask row"):
        cache.check_interval_masks()
    cache.check_interval_masks()  # the count was reset


def test_each_cache_fed_the_same_4d_mask_counts_its_hole():
    """The decode attention's last converted mask was keyed on the mask only: a second cache (same or another
    kernel) fed the same 4-D mask tensor reused the first's intervals, so its hole went uncounted and its
    check_interval_masks passed. Each cache counts it once (its layers after the first still reuse it)."""
    backends = [HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, fused_kv_attention=True,
                                 trace_config=TraceConfig(kernel=k)) for k in ("auto", "reference", "auto")]
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    mask4d = torch.ones(2, 1, 1, 5, dtype=torch.bool)  # SDPA's decode mask: True attends
    mask4d[1, 0, 0, 1] = False  # a hole in row 1
    caches = [be.new_cache(interval_masks=True) for be in backends]
    for be, cache in zip(backends, caches):
        with be.forward_context() as model:
            model(input_ids=ids, use_cache=True, **be.cache_kwargs(cache))
            model(input_ids=ids[:, :1], attention_mask=mask4d, position_ids=torch.tensor([[4], [4]]),
                  use_cache=True, **be.cache_kwargs(cache))
    for cache in caches:
        with pytest.raises(ValueError, match="^1 decode-step mask row"):
            cache.check_interval_masks()


def test_cache_capacity_is_16_aligned_zeros_after_the_history():
    """The buffers grow in multiples of 16 rows, zero-filled past the history: rows the decode attention may read
    (``readable_rows``, its aligned load bound)."""
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, fused_decode=True)
    k = torch.randn(2, 3, 37, 32)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    for _ in range(3):
        cache.update(k[:, :, :1], k[:, :, :1], 0)
    r = layer.readable_rows()
    assert r % 16 == 0 and r >= 40 and layer.get_seq_length() == 40
    for rows in layer._rows.values():
        for buf in rows.store.bufs.values():
            assert buf.shape[2] == r and not buf[:, :, 40:].any()


def test_per_tensor_amax_records_each_steps_amax_on_its_rows():
    """``activation_amax="per_tensor"``: each forward's quantize (the prefill, then one token per step) has one
    amax; the recorder keeps it on that step's rows (as the FP4 cache stores it), so the steps concatenate."""
    cfg = TraceConfig(activation_amax="per_tensor", guided_layers="all")
    be = HFRolloutBackend(tiny_model(seed=1), mode="fp4", trace_config=cfg, dtype=torch.float32)
    out = be.generate([[3, 4, 5], [6, 7, 8]], SamplingParams(max_new_tokens=4, seed=0))
    for site in ("kv_k", "expert_fc1_in"):
        rec = out.guidance[(0, site)].record
        amax = rec.global_amax.reshape(2, rec.shape[1], -1)  # [B, S, rows of a position]
        assert rec.global_amax.shape[-1] == 1 and torch.isfinite(amax).all()
        assert (amax[:, :3] == amax[0, 0, 0]).all()  # the prefill: one chunk
        for s in range(3, out.tokens.shape[1] - 1):  # each decode step: one chunk over the batch
            assert (amax[:, s] == amax[0, s, 0]).all() and amax[0, s, 0] != amax[0, 0, 0]


def test_kv_sites_are_recorded_once_from_the_stored_history():
    """A K/V site of the FP4 cache keeps no per-step chunk: the recorder reads the stored rows once, batch-major,
    and their mantissa bits are the reference's of the stored codes. A recorder that saw other forward calls than
    the cache is an error, not a silently shifted record."""
    be = HFRolloutBackend(tiny_model(seed=1), mode="fp4", trace_config=TraceConfig(guided_layers="all"),
                          dtype=torch.float32)
    rec = GuidanceRecorder(2, be.guided_sites, compact=True)
    key = (0, "kv_k")
    assert key in rec.sites
    with be.forward_context(rec) as model:
        cache = be.new_cache(rec)
        model(input_ids=torch.tensor([[3, 4, 5], [6, 7, 8]]), use_cache=True, **be.cache_kwargs(cache))
        rec.end_step(torch.ones(2, 3, dtype=torch.bool))
        model(input_ids=torch.tensor([[9], [10]]), position_ids=torch.tensor([[3], [3]]), use_cache=True,
              **be.cache_kwargs(cache))
    assert not rec._records[key]
    with pytest.raises(ValueError, match="has 4 positions but 3 were recorded"):
        rec.site_records(key)
    rec.end_step(torch.ones(2, 1, dtype=torch.bool))
    (got,) = rec.site_records(key)
    hist = cache.layers[0].fp4_history("kv_k")  # [B, heads, T, ...]
    assert tuple(got.shape) == (2, 4, *hist.shape[1:2], hist.shape[3])
    bits = e2m1.pack_bits(e2m1.mantissa_bit(e2m1.unpack(hist.codes)))
    assert torch.equal(got.mantissa_bits, bits.transpose(1, 2))
    assert torch.equal(got.block_scales.view(torch.uint8), hist.block_scales.view(torch.uint8).transpose(1, 2))
    assert torch.equal(got.global_amax, hist.global_amax.transpose(1, 2))


@pytest.mark.parametrize("quantize", [True, False])
def test_a_cache_that_outgrows_its_buffers_keeps_every_row(quantize):
    """Past the first allocation (``MIN_GROWTH`` spare rows) the buffers are reallocated and the rows so far copied
    over: the history after the growth is, row for row, the quantize of all the K/V given (per-row scales: one
    quantize of the whole sequence), or the K/V themselves for an unquantized side."""
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, quantize_k=quantize, quantize_v=quantize, kernel="reference")
    k = torch.randn(2, 3, 8 + 3 * 100, 32, generator=torch.Generator().manual_seed(4))
    layer = cache.layers[0]
    cache.update(k[:, :, :8], -k[:, :, :8], 0)
    first = layer.readable_rows()
    for s in range(8, k.shape[2], 100):
        keys, values = cache.update(k[:, :, s:s + 100], -k[:, :, s:s + 100], 0)
    assert layer.readable_rows() > first and first < k.shape[2]  # the buffers were reallocated
    want = q.quantize(k).dequantize(k.dtype) if quantize else k
    assert torch.equal(keys, want) and torch.equal(values, -want)
    if quantize:
        assert torch.equal(layer.fp4_history("kv_k").codes, q.quantize(k).codes)


@pytest.mark.parametrize("quantize", [True, False])
def test_a_fork_of_batch_rows_keeps_each_rows_k_and_v(quantize):
    """``batch_select_indices`` (``generate``'s prefix reuse: repeats fork a row) selects every stored part of K and
    V (codes, scales, per-row amax; or the plain rows): the history after it is the old history's rows, forked; a
    decode step after it appends to each forked row."""
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, quantize_k=quantize, quantize_v=quantize, kernel="reference")
    g = torch.Generator().manual_seed(6)
    k = torch.randn(3, 2, 5, 32, generator=g) * torch.tensor([1.0, 10.0, 100.0])[:, None, None, None]
    keys, values = cache.update(k, -2 * k, 0)
    index = torch.tensor([2, 0, 0, 1])
    cache.layers[0].batch_select_indices(index)
    step = torch.randn(4, 2, 1, 32, generator=g)
    keys2, values2 = cache.update(step, step, 0)
    want_step = q.fake_quantize(step) if quantize else step
    assert torch.equal(keys2, torch.cat([keys[index], want_step], 2))
    assert torch.equal(values2, torch.cat([values[index], want_step], 2))


@pytest.mark.parametrize("quantize", [True, False])
def test_a_prefill_that_fills_a_static_cache_keeps_its_rows_and_advance_moves_k_and_v(quantize):
    """A prefill of exactly ``static_rows`` tokens fits, and every buffer keeps ``static_rows`` rows (not grown: the
    decode attention's masks are [B, 1, 1, static_rows]); ``advance`` moves the K and the V lengths together."""
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, quantize_k=quantize, quantize_v=quantize, static_rows=16, kernel="reference")
    x = torch.randn(2, 1, 16, 32, generator=torch.Generator().manual_seed(7))
    keys, values = cache.update(x, -x, 0)
    layer = cache.layers[0]
    assert keys.shape[2] == 16 and layer.readable_rows() == 16
    assert all(b.shape[2] == 16 for rows in layer._rows.values() for b in rows.store.bufs.values())
    cache = FP4KVCache(1, q, quantize_k=quantize, quantize_v=quantize, static_rows=16, kernel="reference")
    cache.update(x[:, :, :5], -x[:, :, :5], 0)
    cache.decode_position().fill_(5)
    cache.layers[0].update(x[:, :, 5:6], -x[:, :, 5:6])  # a decode write at row 5; the lengths stay
    cache.advance(3)
    assert [rows.store.length for rows in cache.layers[0]._rows.values()] == [8, 8]
    assert cache.layers[0].nbytes() == 2 * cache.layers[0]._rows["kv_k"].nbytes()


def test_static_caches_refuse_zero_rows_and_sglang_kv_on_either_side():
    q = TraceConfig().activation_quantizer()
    with pytest.raises(ValueError, match="static_rows=0 must be a positive multiple of 16"):
        FP4KVCache(1, q, static_rows=0)
    sglang = TraceConfig(kv_format="sglang_kvfp4").kv_quantizer()
    for k_side, v_side in ((True, False), (False, True)):
        with pytest.raises(ValueError, match="static_rows needs"):
            FP4KVCache(1, sglang, quantize_k=k_side, quantize_v=v_side, static_rows=16)
    FP4KVCache(1, sglang, quantize_k=False, quantize_v=False, static_rows=16)  # nothing in SGLang's format: fine


def test_a_head_dim_that_is_not_a_block_multiple_keeps_its_width():
    """head_dim 24 (padded to 32 in the codes): the history and the stored FP4 tensor keep 24 columns."""
    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(1, q, kernel="reference")
    k = torch.randn(1, 2, 3, 24, generator=torch.Generator().manual_seed(8))
    cache.update(k, k, 0)
    keys, _ = cache.update(k[:, :, :1], k[:, :, :1], 0)
    assert keys.shape == (1, 2, 4, 24) and cache.layers[0].fp4_history("kv_v").shape == (1, 2, 4, 24)
    assert torch.equal(keys, q.fake_quantize(torch.cat([k, k[:, :, :1]], 2)))


def test_only_a_layer_with_k_and_v_in_fp4_defers_its_decode_step():
    """``fused_decode``: the fused attention reads packed FP4 K and V; a layer with one side unquantized returns the
    whole dequantized history instead (no deferred step it could not read)."""
    q = TraceConfig().activation_quantizer()
    k = torch.randn(1, 2, 4, 32, generator=torch.Generator().manual_seed(9))
    for quantize_k, quantize_v in ((True, False), (False, True), (False, False)):
        cache = FP4KVCache(1, q, quantize_k=quantize_k, quantize_v=quantize_v, fused_decode=True, kernel="reference")
        cache.update(k, k, 0)
        keys, values = cache.update(k[:, :, :1], -k[:, :, :1], 0)
        assert keys.shape[2] == values.shape[2] == 5 and not hasattr(keys, "_trace_fp4_kv_layer")


def test_a_nonfinite_static_decode_token_is_named_by_layer_and_site():
    from megatron_trace.formats import NonFiniteError
    from megatron_trace.rollout.finite import RolloutFiniteChecks

    q = TraceConfig().activation_quantizer()
    cache = FP4KVCache(2, q, static_rows=16, kernel="reference", finite=RolloutFiniteChecks())
    k = torch.randn(1, 2, 4, 32, generator=torch.Generator().manual_seed(10))
    cache.update(k, k, 1)
    bad = k[:, :, :1].clone()
    bad[0, 1, 0, 3] = float("inf")
    with pytest.raises(NonFiniteError, match="rollout FP4 quantize input at layer 1 kv_v: x holds 1 NaN/Inf"):
        cache.update(k[:, :, :1], bad, 1)
