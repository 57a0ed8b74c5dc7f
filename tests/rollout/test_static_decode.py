"""Fixed-buffer decode steps (``rollout.static_decode``) over a static FP4 KV cache (``FP4KVCache(static_rows=)``):
the growing cache's logits and tokens, K/V rows written at the device position only, host lengths moved only by
``advance``, and named errors for what does not fit. The CUDA-graph replay is tested in
``tests/gpu/test_rollout_gpu.py``."""

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rollout import HFRolloutBackend, SamplingParams
from megatron_trace.rollout.kv_cache import FP4KVCache
from megatron_trace.rollout.static_decode import StaticDecode

from ._tiny import tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]  # the second row left-padded by 2
STEPS = 6


def _backend(mode="fp4", fused=None, exclude=()):
    return HFRolloutBackend(tiny_model(seed=3), mode=mode,
                            trace_config=TraceConfig(guided_layers="all", exclude_modules=exclude),
                            dtype=torch.float32, fused_kv_attention=fused)


def _prefill(be, cache):
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = torch.tensor(p)
    attn = ids != 0
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    out = be.model(input_ids=ids, attention_mask=attn.long(), position_ids=pos, use_cache=True, logits_to_keep=1,
                   **be.cache_kwargs(cache))
    return out.logits[:, -1], attn, pos[:, -1:]


def _greedy(be, static: bool, finish_row_at: int | None = None):
    """Greedy decode of PROMPTS: (logits per step, tokens per step, cache), on a growing or a static cache; row 1
    stops attending its new tokens from step ``finish_row_at`` (a finished row's tail)."""
    with be.forward_context() as model:
        cache = be.new_cache(interval_masks=True, static_rows=32 if static else None)
        logits, attn, pos = _prefill(be, cache)
        runner = StaticDecode(be, cache, attn, pos) if static else None
        all_logits, toks = [], []
        for i in range(STEPS):
            tok = logits.argmax(-1, keepdim=True)
            attend = torch.ones(len(PROMPTS), dtype=torch.bool)
            if finish_row_at is not None and i >= finish_row_at:
                attend[1] = False
            if static:
                logits = runner.step(tok, attend)
            else:
                attn = torch.cat([attn, attend[:, None]], 1)
                pos = pos + 1
                logits = model(input_ids=tok, attention_mask=attn.long(), position_ids=pos, use_cache=True,
                               logits_to_keep=1, **be.cache_kwargs(cache)).logits[:, -1]
            all_logits.append(logits)
            toks.append(tok)
    return torch.stack(all_logits, 1), torch.cat(toks, 1), cache


EXCLUDED_KV = ("model.layers.1.self_attn.kv_cache",)


@pytest.mark.parametrize("mode, fused, finish, exclude", [
    ("fp4", None, None, ()), ("fp4", None, 3, ()), ("fp4", True, 3, ()), ("fp4", True, 3, EXCLUDED_KV),
    ("bf16", None, None, ()), ("bf16", True, 3, ())])
def test_static_steps_give_the_growing_caches_logits(mode, fused, finish, exclude):
    """Also with the fused FP4-KV decode attention (reference math here), which then reads every static row with
    each row's interval taken from the mask, and with the dense decode attention over the static buffers of
    unquantized layers (BF16 mode, an excluded KV cache) where SDPA reads the growing cache."""
    be = _backend(mode, fused, exclude)
    assert be.fused_kv_attention == bool(fused)
    if fused:  # which layers defer their attention to the decode kernels
        layers = be.new_cache(static_rows=32).layers
        assert all(layer.fused_decode for layer in layers)
        assert [layer.quantize_k for layer in layers] == [mode == "fp4" and not (exclude and i == 1)
                                                      for i in range(len(layers))]
        assert not any(getattr(layer, "fused_decode", False) and not layer.quantize_k
                       for layer in be.new_cache().layers)  # growing caches: SDPA
    want, want_tok, grown = _greedy(be, static=False, finish_row_at=finish)
    got, got_tok, static = _greedy(be, static=True, finish_row_at=finish)
    assert torch.equal(got_tok, want_tok)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert static.get_seq_length() == grown.get_seq_length() == max(map(len, PROMPTS)) + STEPS
    if mode == "fp4":  # the stored FP4 rows are the growing cache's, bit for bit
        for site in ("kv_k", "kv_v"):
            a, b = static.layers[2].fp4_history(site), grown.layers[2].fp4_history(site)
            assert torch.equal(a.codes, b.codes)
            assert torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))


def test_a_static_update_writes_at_the_device_row_and_leaves_the_lengths():
    """The one-token update reads the row from ``decode_position`` (a device tensor) and changes no host state:
    what a replayed CUDA graph needs. The lengths move with ``advance`` only."""
    be = _backend()
    with be.forward_context():
        cache = be.new_cache(static_rows=32)
        _prefill(be, cache)
        layer = cache.layers[0]
        k = torch.randn(2, layer._rows["kv_k"].store.bufs["codes"].shape[1], 1, be.hf_config.head_dim)
        cache.decode_position().fill_(11)  # any row: the update does not look at the lengths
        keys, _ = layer.update(k, k)
    assert cache.get_seq_length() == 5 and layer._rows["kv_k"].store.length == 5
    assert keys.shape[2] == 32  # every row of the buffers, the attention mask says which are attended
    want = be.config.kv_quantizer().quantize(k)
    stored = layer._rows["kv_k"].fp4(capacity=True)
    assert torch.equal(stored.codes[:, :, 11:12], want.codes)
    assert not stored.codes[:, :, 5:11].any() and not stored.codes[:, :, 12:].any()
    cache.advance(1)
    assert cache.get_seq_length() == 6 and layer.fp4_history("kv_k").shape[2] == 6
    cache.advance(32 - 6)  # to the last row, and no further
    assert cache.get_seq_length() == 32
    with pytest.raises(ValueError, match=r"advance\(1\) needs a static cache with room: length 32, static rows 32"):
        layer.advance(1)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0


def test_static_cache_errors_name_what_does_not_fit():
    be = _backend()
    with be.forward_context() as model:
        small = be.new_cache(static_rows=16)
        with pytest.raises(ValueError, match="prefill of 17 tokens does not fit static_rows=16"):
            model(input_ids=torch.arange(3, 20)[None], use_cache=True, **be.cache_kwargs(small))
        cache = be.new_cache(static_rows=16)
        logits, attn, pos = _prefill(be, cache)
        runner = StaticDecode(be, cache, attn, pos)
        with pytest.raises(ValueError, match="capture needs the backend on CUDA"):
            runner.capture()
        tok, attend = logits.argmax(-1, keepdim=True), torch.ones(2, dtype=torch.bool)
        # (copy_ broadcast one token [1, 1] to every row, and an attend of floats or of one value to all)
        for bad_tok, bad_attend in ((tok[:1], attend), (tok[:, 0], attend), (tok.float(), attend),
                                    (tok, attend.float()), (tok, attend[:1])):
            with pytest.raises(ValueError, match=r"step needs tokens int \[2, 1\] and attend bool \[2\]"):
                runner.step(bad_tok, bad_attend)
        for _ in range(16 - 5):
            runner.step(tok, attend)
        with pytest.raises(ValueError, match="row 16 is past static_rows=16"):
            runner.step(tok, attend)
    with pytest.raises(ValueError, match="static_rows=20 must be a positive multiple of 16"):
        FP4KVCache(1, be.config.kv_quantizer(), static_rows=20)
    with pytest.raises(ValueError, match="static_rows needs"):
        FP4KVCache(1, TraceConfig(kv_format="sglang_kvfp4").kv_quantizer(), static_rows=16)
    with pytest.raises(ValueError, match="needs an FP4KVCache"):
        StaticDecode(be, be.new_cache(), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 1))


@pytest.mark.parametrize("cache_mode, new_tokens", [("compact", 9), ("full", 9), ("compact", 30)])
def test_generate_with_static_decode_returns_the_same_rollout(cache_mode, new_tokens):
    """``HFRolloutBackend(static_decode="eager")``: generate's decode steps on fixed buffers (the recorder's static
    store, the static cache) give the same tokens, log-probs within float rounding and the same guidance and
    routing as the default loop, with prefix reuse (forked rows), left padding and rows finishing early. With 30
    new tokens every row stops at step 12, and the static loop, which reads ``done`` every STATIC_DONE_CHECK
    steps, feeds finished rows a few steps more: nothing returned changes."""
    cfg = TraceConfig(guided_layers="all", cache_mode=cache_mode)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [7, 8], [7, 8], [12]]
    sampling = SamplingParams(max_new_tokens=new_tokens, seed=3, stop_token_ids=tuple(range(0, 128, 9)))
    outs = {}
    for static in ("off", "eager"):
        be = HFRolloutBackend(tiny_model(seed=4), mode="fp4", trace_config=cfg, dtype=torch.float32,
                              static_decode=static)
        outs[static] = be.generate(prompts, sampling)
    a, b = outs["eager"], outs["off"]
    assert len(set(b.response_mask.sum(1).tolist())) > 1  # rows finished at different steps
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.attention_mask, b.attention_mask)
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.routing.keys() == b.routing.keys() and a.guidance.keys() == b.guidance.keys()
    for layer in b.routing:
        assert torch.equal(a.routing[layer], b.routing[layer])
    for key, sg in b.guidance.items():
        got = a.guidance[key]
        assert torch.equal(got.valid, sg.valid), key
        payload = "codes" if cache_mode == "full" else "mantissa_bits"
        for name in (payload, "block_scales"):  # (float rounding of the attention over the static rows aside)
            x, y = (getattr(r.record, name) for r in (got, sg))
            assert x.shape == y.shape and (x.view(torch.uint8) == y.view(torch.uint8)).float().mean() > 0.999, key


@pytest.mark.parametrize("mode", ["fp4", "bf16"])
@pytest.mark.parametrize("static, fused", [("off", True), ("eager", False), ("eager", True)])
def test_prompts_of_one_token_give_the_default_rollout(mode, static, fused):
    """A prefill of one token per row is a prefill, not a decode step: with the fused decode attention on a static
    cache it must not attend the static buffers' zero rows."""
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    for prompts in ([[40]], [[40], [7]]):
        ref = HFRolloutBackend(tiny_model(seed=4), mode=mode, dtype=torch.float32).generate(prompts, sampling)
        got = HFRolloutBackend(tiny_model(seed=4), mode=mode, dtype=torch.float32, static_decode=static,
                               fused_kv_attention=fused).generate(prompts, sampling)
        assert torch.equal(got.tokens, ref.tokens)
        assert torch.allclose(got.logprobs, ref.logprobs, atol=1e-5)


def test_sglang_kv_format_and_static_decode():
    """SGLang's KV format quantizes on the reference path only: a static decode with it is refused when the
    backend is built; a BF16 backend of the same config (nothing quantized) runs its static decode."""
    cfg = TraceConfig(kv_format="sglang_kvfp4", guided_layers="all")
    with pytest.raises(ValueError, match=r"static_decode='eager' needs the activation quantizer's KV format"):
        HFRolloutBackend(tiny_model(seed=4), mode="fp4", trace_config=cfg, dtype=torch.float32, static_decode="eager")
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
    outs = [HFRolloutBackend(tiny_model(seed=4), mode="bf16", trace_config=cfg, dtype=torch.float32,
                             static_decode=static).generate([[3, 4, 5], [9]], sampling) for static in ("off", "eager")]
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)


def test_static_decode_graph_needs_cuda():
    assert HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32).static_decode == "off"  # auto
    with pytest.raises(ValueError, match="static_decode='graph' captures CUDA graphs"):
        HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, static_decode="graph")
    with pytest.raises(ValueError, match="static_decode='fast' must be one of"):
        HFRolloutBackend(tiny_model(seed=4), mode="fp4", dtype=torch.float32, static_decode="fast")
