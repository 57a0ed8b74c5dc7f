"""Packed sequences (THD, ``megatron/packing.py``): guidance recorded by a padded batch-major forward, laid out by
``pack_step`` for a packed row, guides the packed forward of the same samples row for row.

Megatron's local attention takes no ``packed_seq_params`` on the CPU, so the packed forward is emulated exactly: one
row [1, T] holding the samples (each in its segment, then tail padding), a block-diagonal causal mask, and RoPE
positions restarting per sample (the ``mrope`` position embedding, which takes ``position_ids``)."""

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.site import FallbackCounter
from megatron_trace.megatron import (
    StepGuidance,
    TraceDotProductAttention,
    reuse_weight_quant,
    trace_guidance,
    trace_spec,
)
from megatron_trace.megatron.packing import pack_step
from megatron_trace.megatron.rows import map_record, payload_of
from megatron_trace.megatron.step import GuidanceFallbackError

from ._dist import packed_worker
from .harness import (
    EXPERTS,
    LAYERS,
    MROPE_SECTION,
    SEQ,
    TOPK,
    VOCAB,
    build_model,
    packed_batch,
    padded_batch,
    stock_spec,
    tiny_config,
)
from .test_dist import WORLD, _same_records, _spawn
from .test_microbatches import RECOMPUTE

pytestmark = pytest.mark.usefixtures("world1")

LENGTHS = (5, 9, 16)  # tokens of the three samples (one fills its row)
LAYOUTS = {  # name: (positions after each sample in its segment, tail padding of the packed row)
    "exact": ((0, 0, 0), 0),
    "segment_padding": ((3, 1, 0), 0),  # cu_seqlens_padded: samples padded in their segments
    "tail_padding": ((0, 0, 0), 4),
    "both": ((2, 0, 3), 5),
}


class ThdCoreAttention(TraceDotProductAttention):
    """The KV site fed as Transformer Engine's attention is under ``qkv_format="thd"`` (Megatron's SelfAttention
    squeezes a packed row's batch axis: K/V [T, heads, head_dim]); Megatron's local attention, which takes no
    ``packed_seq_params``, then runs on the quantized K/V."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        thd = PackedSeqParams(qkv_format="thd")
        key = self.quantize_kv("kv_k", key.squeeze(1), thd).unsqueeze(1)
        value = self.quantize_kv("kv_v", value.squeeze(1), thd).unsqueeze(1)
        return DotProductAttention.forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                           attention_bias=attention_bias)


def _model(tc: TraceConfig, core: type | None = None, **cfg_kw):
    """The tiny model with RoPE at the forward's ``position_ids``; ``core``: its core attention class."""
    cfg = tiny_config(mrope_section=MROPE_SECTION, **cfg_kw)
    spec = trace_spec(stock_spec(cfg), tc)
    for layer in spec.layer_specs if core is not None else ():
        layer.submodules.self_attention.submodules.core_attention.module = core
    return build_model(cfg, spec, position_embedding_type="mrope")


def _boundaries(layout: str) -> tuple[list[int], int]:
    extra, tail = LAYOUTS[layout]
    cu = [0]
    for n, e in zip(LENGTHS, extra):
        cu.append(cu[-1] + n + e)
    return cu, cu[-1] + tail


def _forward(model, data, step=None):
    tokens, pos, mask = data
    with trace_guidance(model, step, record=True) as h, torch.no_grad():
        model(tokens, pos, mask)
    return h


def _rows(sg, index: torch.Tensor, lead: int):
    """The record's rows ``index`` of its ``lead`` leading dims flattened: (payload, block scales, amax), valid,
    expert ids."""
    r = sg.record
    rec = map_record(r, lambda t: t.reshape(-1, *t.shape[lead:])[index], (index.numel(), *r.shape[lead:]))
    take = lambda t: None if t is None else t.reshape(-1, *t.shape[lead:])[index]  # noqa: E731
    return payload_of(rec), rec.block_scales.view(torch.uint8), rec.global_amax, take(sg.valid), take(sg.expert_ids)


def _same_rows(a, ia, b, ib, lead: int) -> bool:
    return all(x is y or torch.equal(x, y) for x, y in zip(_rows(a, ia, lead), _rows(b, ib, lead)))


@pytest.fixture(scope="module", params=["right", "left"])
def unpacked(request):
    """(config, model (every layer guided), tokens, token mask, recorded guidance (full NVFP4 records), the
    padded forward's inputs)."""
    tc = TraceConfig(guided_layers="all", cache_mode="full")
    model = _model(tc)
    tokens, tm, pos, mask = padded_batch(LENGTHS, request.param == "left")
    rec = _forward(model, (tokens, pos, mask)).recorded()
    return tc, model, tokens, tm, rec, (tokens, pos, mask)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_forward_reproduces_the_unpacked_records(unpacked, layout):
    """Guided by ``pack_step``'s layout of the unpacked run's records: coverage 1.0 over exactly the samples' rows
    (segment and tail padding not counted), nothing rejected, and the packed run's own records and routing equal the
    unpacked run's token for token (codes, scales, amax, valid flags, expert ids)."""
    _, model, tokens, tm, rec, _ = unpacked
    cu, total = _boundaries(layout)
    counter = FallbackCounter()
    step = StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=tm, counter=counter, min_coverage=1.0,
                        fallback="fail")
    packed = pack_step(step, torch.tensor(cu, dtype=torch.int32), total=total)
    h = _forward(model, packed_batch(tokens, tm, cu, total), packed)
    n = sum(LENGTHS)
    assert h.counter is counter and not counter.fallback and h.coverage() == 1.0
    assert counter.used == LAYERS * (n + n * TOPK + n + n)  # fc1, fc2 per (token, expert), kv_k, kv_v
    b, s = tm.nonzero().unbind(1)
    src = b * SEQ + s  # batch-major token rows, sample by sample
    dst = torch.cat([torch.arange(c, c + k) for c, k in zip(cu, LENGTHS)])
    out = h.recorded()
    assert set(out.sites) == set(rec.sites)
    for key, sg in rec.sites.items():
        assert tuple(out.sites[key].record.shape[:2]) == (1, total), key
        assert _same_rows(sg, src, out.sites[key], dst, 2), key
    for layer, r in rec.routing.items():
        assert torch.equal(out.routing[layer][0, dst], r.reshape(-1, TOPK)[src]), layer


def test_invalid_rows_are_counted_as_in_the_unpacked_forward(unpacked):
    """Records with rows marked invalid (here 30%, at random): the packed forward counts exactly the unpacked
    forward's rows by (layer, site, reason), and records the same rows (its own rounding where invalid)."""
    _, model, tokens, tm, rec, padded = unpacked
    g = torch.Generator().manual_seed(1)
    sites = {k: dataclasses.replace(sg, valid=sg.valid & (torch.rand(sg.valid.shape, generator=g) > 0.3))
             for k, sg in rec.sites.items()}
    step = lambda: StepGuidance(sites=sites, routing=rec.routing, token_mask=tm)  # noqa: E731
    un = _forward(model, padded, step())
    cu, total = _boundaries("both")
    packed = _forward(model, packed_batch(tokens, tm, cu, total), pack_step(step(), cu, total=total))
    assert packed.stats() == un.stats() and 0.6 < packed.coverage() < 0.8
    b, s = tm.nonzero().unbind(1)
    dst = torch.cat([torch.arange(c, c + k) for c, k in zip(cu, LENGTHS)])
    a, p = un.recorded(), packed.recorded()
    for key in a.sites:
        assert _same_rows(a.sites[key], b * SEQ + s, p.sites[key], dst, 2), key


@pytest.fixture(scope="module")
def microbatches():
    """Two micro-batches (padded inputs, packed inputs, rollout records of a slightly different model, token mask,
    boundaries, the samples' rows in each layout, loss weights): right-padded in padded segments with tail padding,
    and left-padded with a sample of 0 tokens."""
    roll = _model(TraceConfig(guided_layers="all"), init_method_std=0.051)
    out = []
    for seed, (lengths, left, extra, tail) in enumerate((((5, 9, 16), False, (2, 0, 3), 5),
                                                          ((12, 0, 7), True, (0, 1, 1), 3))):
        tokens, tm, pos, mask = padded_batch(lengths, left, seed=seed)
        cu = [0, *torch.tensor(lengths).add(torch.tensor(extra)).cumsum(0).tolist()]
        b, s = tm.nonzero().unbind(1)
        out.append(dict(padded=(tokens, pos, mask), packed=packed_batch(tokens, tm, cu, cu[-1] + tail),
                        rec=_forward(roll, (tokens, pos, mask)).recorded(), tm=tm, cu=cu, total=cu[-1] + tail,
                        rows={"padded": b * SEQ + s,
                              "packed": torch.cat([torch.arange(c, c + k) for c, k in zip(cu, lengths)])},
                        w=torch.randn(len(b), VOCAB, generator=torch.Generator().manual_seed(seed))))
    return out


@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_packed_microbatches_give_the_padded_ones_expert_gradients(microbatches, kind):
    """One context over two micro-batches (``trace_guidance(model, [packed0, packed1])``), the expert weights
    quantized once (``reuse_weight_quant``), activations recomputed as ``kind`` says, a loss over the samples' tokens:
    the packed micro-batches count the padded ones' rows by (layer, site, reason) and give the expert weights the
    same gradients, bit for bit. The experts take the tokens in another order (sample by sample, not position by
    position): bit-equal here, where each weight gradient sums a few bf16 products exactly in fp32; with many more
    tokens per expert (EP=2 with both ranks' tokens: 1 bf16 ulp) the order shows, as in Megatron's own reductions.
    (The other weights' gradients differ in the last bits: attention and the embedding sum over other rows.)"""
    tc = TraceConfig(guided_layers="last_k", guided_last_k=2)
    grads, stats = {}, {}
    for layout in ("padded", "packed"):
        model = _model(tc, **RECOMPUTE[kind])
        steps = [StepGuidance(sites=m["rec"].sites, routing=m["rec"].routing, token_mask=m["tm"]) for m in microbatches]
        if layout == "packed":
            steps = [pack_step(st, m["cu"], total=m["total"]) for st, m in zip(steps, microbatches)]
        with reuse_weight_quant(model), trace_guidance(model, steps) as h:
            for m in microbatches:
                logits = model(*m[layout])
                (logits.reshape(-1, VOCAB)[m["rows"][layout]].float() * m["w"]).sum().backward()
        grads[layout] = {n: p.grad for n, p in model.named_parameters() if ".experts." in n}
        stats[layout] = h.stats()
    assert stats["packed"] == stats["padded"]
    assert _rows_used(stats["packed"]) == 2 * (n := sum(LENGTHS) + 19) * (1 + TOPK + 2) and n == 49
    assert grads["packed"].keys() == grads["padded"].keys() and grads["padded"]
    assert all(torch.equal(grads["packed"][k], g) for k, g in grads["padded"].items())


def _rows_used(stats: dict) -> int:
    return sum(v for (_, _, reason), v in stats.items() if reason == "used")


@pytest.mark.parametrize("packed", [False, True], ids=["samples", "columns"])
def test_cache_assembled_guidance_with_a_sample_missing_counts_as_unpacked(unpacked, packed):
    """Guidance through the cache's assembly (``records.assemble`` from samples, ``assemble_packed`` from columns),
    sample 1 missing (its rows zero and invalid): the packed forward counts the padded one's rows by (layer, site,
    reason), and with ``fallback="fail"`` both refuse with the same error. Assembled straight into the packed row
    (``layout=``), guidance and routing drive the packed forward to pack_step's counts, error and records."""
    from megatron_trace.guidance.packed_assemble import assemble_packed
    from megatron_trace.guidance.records import assemble, pack_guidance, split_batch
    from megatron_trace.guidance.routing import assemble_routing, split_routing
    from megatron_trace.megatron import packed_layout

    _, model, tokens, tm, rec, padded = unpacked
    ids, counter = [0, None, 2], FallbackCounter()
    if packed:
        sites = assemble_packed([pack_guidance(rec.sites, tokens, version=0, attention_mask=tm)], ids, tokens,
                                versions=0, counter=counter, attention_mask=tm)
    else:
        samples = split_batch(rec.sites, tokens, version=0, attention_mask=tm)
        sites = assemble([None if i is None else samples[i] for i in ids], tokens, versions=0, counter=counter,
                         attention_mask=tm)
    assert counter.fallback["missing"] > 0
    cu, total = _boundaries("both")
    # the same assembly straight into the packed row (``layout=``): the same tensors as pack_step's, bit for bit
    layout, direct_counter = packed_layout(torch.tensor(cu, dtype=torch.int32), total=total), FallbackCounter()
    if packed:
        direct = assemble_packed([pack_guidance(rec.sites, tokens, version=0, attention_mask=tm)], ids, tokens,
                                 versions=0, counter=direct_counter, attention_mask=tm, layout=layout)
    else:
        direct = assemble([None if i is None else samples[i] for i in ids], tokens, versions=0,
                          counter=direct_counter, attention_mask=tm, layout=layout)
    assert direct_counter == counter
    routes = split_routing(rec.routing, tokens, version=0, num_experts=EXPERTS, attention_mask=tm)
    direct_routing = assemble_routing(routes, tokens, versions=0, attention_mask=tm, layout=layout)
    stats, errors, records = [], [], []
    for fallback in ("rne", "fail"):
        for how in ("padded", "packed", "direct"):
            step = StepGuidance(sites=sites, routing=rec.routing, token_mask=tm, fallback=fallback)
            data = padded
            if how == "packed":
                step, data = pack_step(step, cu, total=total), packed_batch(tokens, tm, cu, total)
            elif how == "direct":
                step = StepGuidance(sites=direct, routing=direct_routing, token_mask=layout.token_mask(tm),
                                    fallback=fallback)
                data = packed_batch(tokens, tm, cu, total)
            if fallback == "rne":
                h = _forward(model, data, step)
                stats.append(h.stats())
                records.append(h.recorded())
                continue
            with pytest.raises(GuidanceFallbackError) as e:
                _forward(model, data, step)
            errors.append(str(e.value))
    assert stats[0] == stats[1] and _rows_used(stats[0]) == LAYERS * (n := sum(LENGTHS) - 9) * (1 + TOPK + 2), n
    assert errors[0] == errors[1] and "{'invalid_row': 9}" in errors[0]
    assert stats[2] == stats[1] and errors[2] == errors[1]
    _same_records(records[2], records[1])


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_packed_forward_equals_ep1(tmp_path, dispatcher):
    """EP=2 (2 gloo ranks), each rank a packed row of its own samples (left- / right-padded, segment and tail
    padding): the FC2 rows reach the experts' ranks and come back as at EP=1, logits, records and counts equal bit
    for bit, every row used. (The rows are of one length: Megatron's allgather dispatcher gathers equal shards.)"""
    tc = TraceConfig(guided_layers="all", cache_mode="full")
    model = _model(tc)
    steps, data = [], []
    for rank in range(WORLD):
        tokens, tm, pos, mask = padded_batch(LENGTHS, left=bool(rank), seed=rank)
        rec = _forward(model, (tokens, pos, mask)).recorded()
        cu, total = _boundaries(("both", "segment_padding")[rank])
        total = _boundaries("both")[1]  # (rank 1: tail padding to rank 0's length)
        step = StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=tm, fallback="fail")
        steps.append(pack_step(step, cu, total=total))
        data.append(packed_batch(tokens, tm, cu, total))
    torch.save({"trace_config": tc, "state_dict": model.state_dict(), "steps": steps, "data": data},
               tmp_path / "shared.pt")
    results = _spawn(packed_worker, tmp_path, dispatcher)
    for rank, got in enumerate(results):
        with trace_guidance(model, steps[rank], record=True) as h, torch.no_grad():
            logits = model(*data[rank])
        assert torch.equal(got["logits"], logits), rank
        _same_records(got["recorded"], h.recorded())
        assert got["counter"] == h.counter and h.coverage() == 1.0, rank


@pytest.mark.slow
def test_tensor_and_sequence_parallel_packed_forward_equals_the_padded_one(unpacked, tmp_path):
    """TP=2 with sequence parallelism (2 gloo ranks, the same samples on both): the packed forward guided by
    ``pack_step``'s layout and the padded forward guided by the batch-major step give each rank the same logits at
    the samples' tokens, bit for bit, and every row used: MoE rows counted on the rank holding the token's sequence
    shard (a padded and a packed row shard the tokens differently: equal over the ranks), KV rows on every rank."""
    tc, _, tokens, tm, rec, padded = unpacked
    cu, total = _boundaries("both")  # (total even: a sequence shard per rank)
    step = StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=tm, fallback="fail")
    b, s = tm.nonzero().unbind(1)
    dst = torch.cat([torch.arange(c, c + k) for c, k in zip(cu, LENGTHS)])
    runs = {"padded": (dataclasses.replace(step, counter=FallbackCounter()), padded, b * SEQ + s),  # (a counter each)
            "packed": (pack_step(step, cu, total=total), packed_batch(tokens, tm, cu, total), dst)}
    torch.save({"trace_config": tc, "runs": runs}, tmp_path / "shared.pt")
    results = _spawn(packed_worker, tmp_path, "tp")
    n = sum(LENGTHS)
    for rank, got in enumerate(results):
        assert torch.equal(got["packed"]["logits"], got["padded"]["logits"]), rank
        assert not got["packed"]["counter"].fallback and not got["padded"]["counter"].fallback, rank
    for run in runs:
        used = sum(got[run]["counter"].used for got in results)
        assert used == LAYERS * (n * (1 + TOPK) + WORLD * 2 * n), run  # MoE rows once, KV rows on every rank


def test_pack_step_layout_matches_an_independent_placement(unpacked):
    """Each counted token's rows at cu_seqlens[b] + its index in the sample, zeros and invalid elsewhere (segment
    and tail padding), the token mask True exactly there; counter, fallback and min_coverage carried over."""
    _, _, _, tm, rec, _ = unpacked
    cu, total = _boundaries("both")
    step = StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=tm, fallback="rne", min_coverage=0.5)
    packed = pack_step(step, cu, total=total)
    place = {}  # packed position -> batch-major token row, by loops
    for b in range(len(LENGTHS)):
        positions = [s for s in range(SEQ) if tm[b, s]]
        place.update({cu[b] + i: b * SEQ + s for i, s in enumerate(positions)})
    assert packed.token_mask.tolist() == [[t in place for t in range(total)]]
    assert packed.counter is step.counter and (packed.fallback, packed.min_coverage) == ("rne", 0.5)
    dst, src = torch.tensor(sorted(place)), torch.tensor([place[t] for t in sorted(place)])
    pad = torch.tensor([t for t in range(total) if t not in place])
    for key, sg in rec.sites.items():
        p = packed.sites[key]
        assert _same_rows(sg, src, p, dst, 2), key
        payload, scales, amax, valid, ids = _rows(p, pad, 2)
        assert not valid.any() and not payload.any() and not scales.any() and not amax.any(), key
        assert ids is None or not ids.any(), key
    for layer, r in rec.routing.items():
        assert torch.equal(packed.routing[layer][0, dst], r.reshape(-1, TOPK)[src])
        assert not packed.routing[layer][0, pad].any()  # expert 0 at padding, as assemble_routing fills it
    # the forward's PackedSeqParams: its padded boundaries where set (where the samples are), else cu_seqlens_q
    true = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    for params, want in ((PackedSeqParams(qkv_format="thd", cu_seqlens_q=true, cu_seqlens_q_padded=torch.tensor(cu)),
                          packed),
                         (PackedSeqParams(qkv_format="thd", cu_seqlens_q=true), pack_step(step, true, total=total))):
        got = pack_step(step, params, total=total)
        assert torch.equal(got.token_mask, want.token_mask)
        assert all(_same_rows(got.sites[k], torch.arange(total), want.sites[k], torch.arange(total), 2)
                   for k in rec.sites)


def test_thd_key_value_give_the_rows_of_the_four_dim_call(unpacked):
    """K/V as TE's attention takes them under qkv_format "thd" ([T, heads, head_dim]) are quantized as the
    [T, 1, heads, head_dim] call: the same records (guided rows included) and counts, bit for bit."""
    tc, model, tokens, tm, rec, _ = unpacked
    cu, total = _boundaries("both")
    data = packed_batch(tokens, tm, cu, total)
    step = lambda: pack_step(StepGuidance(sites=rec.sites, routing=rec.routing, token_mask=tm), cu, total=total)  # noqa: E731
    four = _forward(model, data, step())
    thd_model = _model(tc, core=ThdCoreAttention)
    assert isinstance(thd_model.decoder.layers[0].self_attention.core_attention, ThdCoreAttention)
    thd = _forward(thd_model, data, step())
    assert thd.stats() == four.stats() and thd.coverage() == 1.0
    a, b = four.recorded(), thd.recorded()
    rows = torch.arange(total)
    for key in a.sites:
        assert _same_rows(a.sites[key], rows, b.sites[key], rows, 2), key


def test_thd_key_value_with_context_parallelism_are_refused(unpacked):
    """Context parallelism hands each rank 2 * cp chunks of every packed sample (no [1, T] rows to take): refused
    by name at the KV site, also where the step carries no guidance (``trace_guidance`` refuses that earlier)."""
    tc, _, tokens, tm, _, _ = unpacked
    cu, total = _boundaries("exact")
    model = _model(tc, core=ThdCoreAttention)
    model.config.context_parallel_size = 2  # (Megatron's local attention refuses to be built with it)
    data = packed_batch(tokens, tm, cu, total)
    with pytest.raises(ValueError, match=r"packed sequences \(qkv_format='thd'\) with context_parallel_size=2 "):
        with trace_guidance(model, None), torch.no_grad():  # (not recording: trace_guidance refuses that first)
            model(*data)
    model.config.context_parallel_size = 1
    _forward(model, data)


@pytest.mark.parametrize("cu,kw,match", [
    (torch.tensor([0.0, 5, 14, 30]), {}, r"cu_seqlens must be integer .* got torch.float32"),
    (torch.tensor([False, True, True, True]), {}, r"cu_seqlens must be integer .* got torch.bool"),
    (torch.tensor([[0, 5, 14, 30]]), {}, r"cu_seqlens must be 1-D \[B \+ 1\], got shape \(1, 4\)"),
    ([0, 5.0, 14, 30], {}, r"cu_seqlens must be 1-D integers, got 5.0"),
    ("0,5,14,30", {}, r"cu_seqlens must be an integer tensor or a list of ints \[B \+ 1\] \(or a PackedSeqParams\), "
                      "got str"),
    (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 5, 14, 30])), {},
     r"PackedSeqParams.qkv_format='sbhd': pack_step lays guidance out for packed rows, qkv_format='thd'"),
    ([0, 5, 14], {}, r"cu_seqlens has 3 entries, the micro-batch has B=3 samples: need B \+ 1 = 4"),
    ([0, 5, 14, 30, 32], {}, r"cu_seqlens has 5 entries, the micro-batch has B=3 samples: need B \+ 1 = 4"),
    ([1, 6, 15, 31], {}, r"cu_seqlens must start at 0, got 1"),
    ([0, 14, 5, 30], {}, r"cu_seqlens must not decrease: cu_seqlens\[2\]=5 < cu_seqlens\[1\]=14"),
    ([0, 5, 13, 29], {}, r"sample 1 has 9 tokens, longer than its segment cu_seqlens\[1:3\]=\[5, 13\] \(8 positions\)"),
    ([0, 5, 14, 30], dict(total=29), r"total=29 must be an int >= cu_seqlens\[-1\]=30"),
    ([0, 5, 14, 30], dict(total=30.0), r"total=30.0 must be an int >= cu_seqlens\[-1\]=30"),
    ([0, 5, 14, 30], dict(total=True), r"total=True must be an int >= cu_seqlens\[-1\]=30"),
    # the samples' lengths (cu_seqlens_q, set apart from the padded segments) are not the token mask's: a sample's
    # last token in the packed row (or a padding position) would take no guidance, uncounted
    (PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 15, 31]),
                     cu_seqlens_q_padded=torch.tensor([0, 8, 18, 34])), {},
     r"sample 1 has 9 tokens in its token_mask row, but the PackedSeqParams holds 10 \(cu_seqlens_q, the samples' "
     r"lengths: \[5, 10, 16\]\)"),
    (PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 13, 29]),
                     cu_seqlens_q_padded=torch.tensor([0, 8, 18, 34])), {},
     r"sample 0 has 5 tokens in its token_mask row, but the PackedSeqParams holds 4 "),
], ids=["float", "bool", "2d", "float-in-list", "str", "sbhd-params", "short", "long", "start", "decreasing",
        "sample-too-long", "total-short", "total-float", "total-bool", "params-sample-longer", "params-sample-shorter"])
def test_pack_step_refuses_boundaries_that_place_no_sample(cu, kw, match):
    tm = torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]
    with pytest.raises(ValueError, match=match):
        pack_step(StepGuidance(token_mask=tm), cu, **kw)


def test_pack_step_needs_the_batch_shape():
    with pytest.raises(ValueError, match=r"pack_step needs the micro-batch's \[B, S\]: give the StepGuidance a "
                                         "token_mask"):
        pack_step(StepGuidance(), [0, 4])
    with pytest.raises(TypeError, match="pack_step takes a StepGuidance, got dict"):
        pack_step({}, [0, 4])
