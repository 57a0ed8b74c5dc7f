"""``planner.sample_bytes`` / ``shard_bytes`` / ``plan_row`` against real records: the bytes that ``split_batch``
samples hold, that ``plan_flat`` lays out and ``GuidanceCache`` holds (host cache) and that ``GuidanceSync`` would send
(``encode``'s messages)."""

import dataclasses
import json

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.guidance.planner import (
    RLSettings,
    plan_row,
    rank_projection,
    sample_bytes,
    shard_bytes,
    sync_header_bound,
)
from megatron_trace.guidance.records import split_batch
from megatron_trace.guidance.routing import plan_routing, split_routing
from megatron_trace.guidance.selection import guided_layers
from megatron_trace.guidance.serial import plan_flat
from megatron_trace.guidance.site import SiteGuidance

DIMS = ModelDims(num_layers=3, hidden=40, moe_ffn=24, topk=2, kv_heads=2, head_dim=20, moe_layers=(1, 2),
                 kv_layers=(0, 1, 2), num_experts=300)  # K not a block multiple; > 256 experts: int16 routing


def _batch(cfg: TraceConfig, B: int, S: int, gen) -> dict:
    """Batch-major records of every guided (layer, site) DIMS has, from the config's own quantizer, with a
    per-tensor amax stored on every row as the recorders store it."""
    q, out = cfg.activation_quantizer(), {}
    for layer in guided_layers(cfg, DIMS.num_layers):
        for site in cfg.guided_sites:
            if not DIMS.has_site(layer, site):
                continue
            rows, k = DIMS.site_rows(site)
            shape = (B, S, k) if site == "expert_fc1_in" else (B, S, rows, k)
            rec = q.quantize(torch.randn(shape, generator=gen)).guidance(cfg.cache_mode == "compact")
            if rec.global_amax is not None and rec.global_amax.dim() == 0:
                rec = dataclasses.replace(rec, global_amax=rec.global_amax.expand(*shape[:-1], 1).contiguous())
            fc2 = site == "expert_fc2_in"
            ids = torch.randint(0, DIMS.num_experts, (B, S, rows), generator=gen) if fc2 else None
            out[(layer, site)] = SiteGuidance(rec, torch.ones(shape[:-1] if fc2 else (B, S), dtype=torch.bool), ids)
    return out


@pytest.mark.parametrize("kw", [
    dict(), dict(cache_mode="full"), dict(activation_amax="per_tensor"), dict(format="mxfp4"),
    dict(format="mxfp4", cache_mode="full", guided_sites=("expert_fc2_in", "kv_v")),
], ids=["nvfp4-compact", "nvfp4-full", "per-tensor-amax", "mxfp4-compact", "mxfp4-full-two-sites"])
def test_shard_bytes_equal_real_records(kw, gen):
    cfg = TraceConfig(guided_layers="all", **kw)
    B, S = 3, 7
    tokens = torch.randint(0, 100, (B, S), generator=gen)
    lengths = [7, 4, 0]  # right padding: samples of different lengths, one of none (an empty response)
    samples = split_batch(_batch(cfg, B, S, gen), tokens, version=0, lengths=lengths)
    routing = split_routing({i: torch.randint(0, DIMS.num_experts, (B, S, DIMS.topk), generator=gen)
                             for i in DIMS.moe_layers}, tokens, version=0, num_experts=DIMS.num_experts,
                            lengths=lengths)
    want = shard_bytes(DIMS, cfg, lengths)
    for s, n in zip(samples, lengths):
        one = sample_bytes(DIMS, cfg, n)
        assert one["guidance"] == s.guidance_nbytes() and one["flat"] == plan_flat([s]).total
    assert want["guidance"] == sum(s.guidance_nbytes() for s in samples)
    assert want["flat"] == plan_flat(samples).total
    assert want["routing"] == plan_routing(routing)[1]
    assert want["samples"] == B


def test_sync_payload_equals_what_guidance_sync_sends(gen):
    """The payload ``GuidanceSync.encode`` builds: the exact last (here: only) chunk ``send`` puts on the wire.
    The config's default layer policy (deepest half) guides layers 1 and 2; the routing covers both MoE layers."""
    from megatron_trace.guidance.sync import GuidanceSync

    cfg = TraceConfig()
    B, S = 2, 5
    tokens = torch.randint(0, 100, (B, S), generator=gen)
    samples = split_batch(_batch(cfg, B, S, gen), tokens, version=3)
    routing = split_routing({i: torch.randint(0, DIMS.num_experts, (B, S, DIMS.topk), generator=gen)
                             for i in DIMS.moe_layers}, tokens, version=3, num_experts=DIMS.num_experts)
    sync = GuidanceSync.__new__(GuidanceSync)  # encode reads only ``verify``: no process group (two ranks) needed
    sync.verify = True
    payload = sync.encode(samples, routing)[2]
    assert payload.numel() == shard_bytes(DIMS, cfg, [S] * B)["sync_payload"]


def test_rank_projection_scales_with_ranks_and_bandwidth(caplog):
    cfg = TraceConfig()
    rl = RLSettings(trajectories=64, prompt_len=3, response_len=5)
    one = rank_projection(DIMS, cfg, rl, dp_ranks=1, bandwidths_gbytes={"link": 2.0})
    four = rank_projection(DIMS, cfg, rl, dp_ranks=4, bandwidths_gbytes={"link": 2.0})
    assert one["sync_payload_bytes_per_rank"] == 4 * four["sync_payload_bytes_per_rank"]
    assert four["guidance_bytes_per_rank"] == shard_bytes(DIMS, cfg, [8] * 16)["guidance"]
    assert four["sync_seconds"]["link"] == four["sync_payload_bytes_per_rank"] / 2e9
    for bad in (0, 2.5, True):  # (2.5 used to size ceil(64 / 2.5) = 26 samples a rank, True one rank)
        with pytest.raises(ValueError, match=f"dp_ranks={bad!r} must be an int >= 1"):
            rank_projection(DIMS, cfg, rl, dp_ranks=bad)
    for bad in (0.0, True):  # (True used to be 1 GB/s)
        with pytest.raises(ValueError, match=f"GB/s > 0, got {{'link': {bad!r}}}"):
            rank_projection(DIMS, cfg, rl, dp_ranks=2, bandwidths_gbytes={"link": bad})
    with pytest.raises(ValueError, match="num_experts"):
        sample_bytes(ModelDims(1, 8, 8, 1, 1, 8, (0,), (0,)), cfg, 4)
    with caplog.at_level("WARNING", logger="megatron_trace.guidance.planner"):
        assert rank_projection(DIMS, cfg, rl, dp_ranks=64)["samples_per_rank"] == 1
        assert not caplog.records  # (as many ranks as samples: each trains one)
        many = rank_projection(DIMS, cfg, rl, dp_ranks=80)
    assert many["samples_per_rank"] == 1 and "dp_ranks=80 > trajectories=64: 16 ranks would train no sample" in (
        caplog.text)


@pytest.mark.parametrize("call,match", [
    (lambda c: sample_bytes(DIMS, c, 2.5), r"num_tokens=2.5 must be an int >= 0"),
    (lambda c: sample_bytes(DIMS, c, True), r"num_tokens=True must be an int >= 0"),
    (lambda c: shard_bytes(DIMS, c, [8, 2.5]), r"sample_tokens holds \[2.5\]: each must be a token count"),
    (lambda c: shard_bytes(DIMS, c, ["3"]), r"sample_tokens holds \['3'\]: each must be a token count"),
    (lambda c: shard_bytes(DIMS, c, "33"), r"sample_tokens='33' must be a list of token counts"),
    (lambda c: sync_header_bound(DIMS, c, [True]), r"sample_tokens holds \[True\]: each must be a token count"),
    (lambda c: sample_bytes(DIMS, c, 4, layers=[3]), r"layer=3 outside 0..2"),
    (lambda c: shard_bytes(DIMS, c, [4], layers=[1.5]), r"layer=1.5 must be an int layer id in 0..2"),
    (lambda c: sync_header_bound(DIMS, c, [4], payload=-1), r"payload=-1 must be an int >= 0"),
    (lambda c: sync_header_bound(DIMS, c, [4], payload=1e9), r"payload=1000000000.0 must be an int >= 0"),
], ids=["tokens-float", "tokens-bool", "sample-float", "sample-str", "samples-str", "header-bool", "layer-beyond",
        "layer-float", "header-payload-negative", "header-payload-float"])
def test_token_counts_and_layers_are_named(call, match):
    """Were accepted: 2.5 tokens gave float bytes in ``sample_bytes`` and were truncated to 2 by ``shard_bytes`` and
    ``sync_header_bound``, "3" was parsed, True one token; a layer off the model or 1.5 had no site (0 bytes)."""
    with pytest.raises(ValueError, match=match):
        call(TraceConfig(guided_layers="all"))


def test_cli_per_rank_projection(capsys):
    import json
    from pathlib import Path

    from megatron_trace.cli import plan

    cfg_path = Path(__file__).parent.parent / "data" / "deepseek_v3_config.json"
    argv = ["--hf-config", str(cfg_path), "--layer-policy", "fraction=0.5", "--modes", "compact", "--trajectories",
            "64", "--dp-ranks", "8", "--dp-ranks", "16", "--bandwidth-gbytes", "nvlink=100"]
    assert plan.main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    dims = ModelDims.from_hf_config(cfg_path)
    rl = RLSettings(trajectories=64)
    cfg = TraceConfig(guided_layers="fraction", guided_fraction=0.5, cache_mode="compact")
    assert row["per_rank"] == [rank_projection(dims, cfg, rl, dp_ranks=n, bandwidths_gbytes={"nvlink": 100.0})
                               for n in (8, 16)]
    assert row["per_rank"][0]["guidance_bytes_per_rank"] == row["bytes_per_step"] // 8  # 64 samples / 8 ranks
    assert plan.main(argv) == 0
    assert "8 DP ranks: 8 samples" in capsys.readouterr().out
    assert plan.main([*argv, "--bandwidth-gbytes", "fast=x"]) == 2
    assert "NAME=GB/s" in capsys.readouterr().err
    # without --dp-ranks a bandwidth times nothing: it used to be dropped without a word
    assert plan.main(argv[:argv.index("--dp-ranks")] + ["--bandwidth-gbytes", "nvlink=100"]) == 2
    assert "--bandwidth-gbytes nvlink=100 times a trainer rank's share: add --dp-ranks N" in capsys.readouterr().err


@pytest.mark.parametrize("mode,replay,kv_format", [
    ("compact", True, ""), ("compact", False, ""), ("full", True, ""), ("full", False, ""),
    ("compact", True, "sglang_kvfp4"),
], ids=["compact-replay", "compact-no-replay", "full-replay", "full-no-replay", "compact-replay-sglang-kv"])
def test_plan_table_host_and_sync_bytes_are_a_tiny_models_real_bytes(mode, replay, kv_format):
    """The plan table's host memory and sync time used to count the guidance alone (here 4032 / 8568 bytes a step,
    compact / full, where the cache holds 5355 / 9891 and GuidanceSync sends 10.1-15.0 KB). Now: host memory is what
    ``GuidanceCache`` holds for a tiny model's real rollout batches (guidance + valid flags + FC2 int64 expert ids),
    exactly; sync bytes bound what ``GuidanceSync`` encodes for a step (size message, header, payload with the
    routing), and the bound's slack is exactly what ``sync_header_bound`` allows: int64-wide sample ids and versions,
    offsets as wide as the payload, and the payload's last field padded. With ``kv_format="sglang_kvfp4"`` the K/V
    records are SGLang's format (no amax row), the FC1/FC2 records NVFP4 (an amax per row)."""
    from megatron_trace.guidance.cache import GuidanceCache
    from megatron_trace.guidance.records import pack_guidance
    from megatron_trace.guidance.sync import GuidanceSync
    from megatron_trace.rollout import HFRolloutBackend, SamplingParams

    from ..rollout._tiny import tiny_config, tiny_model

    cfg = TraceConfig(guided_layers="all", cache_mode=mode, routing_replay=replay, kv_format=kv_format)
    dims = ModelDims.from_hf_config(tiny_config().to_dict())
    rollout = HFRolloutBackend(tiny_model(), mode="fp4", trace_config=cfg)
    rl = RLSettings(trajectories=3, prompt_len=3, response_len=4, steps_in_flight=2)
    cache = GuidanceCache(1 << 30)
    for step in range(rl.steps_in_flight):  # the RL driver's path: one whole batch's columns per step
        out = rollout.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13]], SamplingParams(max_new_tokens=4, seed=step))
        assert out.attention_mask.sum(1).tolist() == [7, 7, 7] and len(out.routing) == len(dims.moe_layers)
        assert {sg.record.fmt for (_, site), sg in out.guidance.items() if site in ("kv_k", "kv_v")} == {
            cfg.kv_record_format}
        packed = pack_guidance(out.guidance, out.tokens, version=step, attention_mask=out.attention_mask)
        cache.put(step, packed)
    row = plan_row(dims, cfg, rl, "all")
    assert row["bytes_per_step"] == packed.guidance_nbytes()
    assert row["host_bytes"] == cache.host_bytes > rl.steps_in_flight * row["bytes_per_step"]

    samples = split_batch(out.guidance, out.tokens, version=1, attention_mask=out.attention_mask)
    routing = split_routing(out.routing, out.tokens, version=1, num_experts=dims.num_experts,
                            attention_mask=out.attention_mask) if replay else ()
    sync = GuidanceSync.__new__(GuidanceSync)  # encode reads only ``verify``: no process group (two ranks) needed
    sync.verify = True
    sizes, header, payload = sync.encode(samples, routing)  # the messages ``send`` puts on the wire for this step
    sent = sizes.nbytes + header.numel() + payload.numel()
    assert row["bytes_per_step"] < sent <= row["sync_bytes"]
    head = json.loads(bytes(header.tolist()))
    assert (head["routing"] is not None) == replay
    fields = [f for sec in ("guidance", "routing") if head[sec] for c in head[sec]["columns"] for f in c["fields"]]
    padded = -(-payload.numel() // 16) * 16
    table = head["guidance"]["table"]
    slack = (sum(2 * 20 - len(str(i)) - len(str(v)) for i, v in zip(table["ids"], table["versions"]))
             + sum(len(str(padded)) - len(str(f[3])) for f in fields) + padded - payload.numel())
    assert row["sync_bytes"] - sent == slack
    assert row["sync_seconds"] == row["sync_bytes"] * 8 / (rl.bandwidth_gbps * 1e9)


def _encode(samples, routing=()):
    from megatron_trace.guidance.sync import GuidanceSync

    sync = GuidanceSync.__new__(GuidanceSync)  # encode reads only ``verify``: no process group (two ranks) needed
    sync.verify = True
    return sync.encode(samples, routing)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_rank_projection_is_one_ranks_real_share(replay, gen):
    """10 trajectories over 4 DP ranks: the busiest rank trains ceil(10 / 4) = 3 whole samples (ranks of 3, 3, 2, 2;
    a floor of 2 would leave 2 samples untrained). Its guidance, host cache (x steps in flight), routing and sync
    payload are the bytes of 3 real samples' records, routing only with routing replay."""
    cfg = TraceConfig(guided_layers="all", routing_replay=replay)
    rl = RLSettings(trajectories=10, prompt_len=2, response_len=3, steps_in_flight=3)
    proj = rank_projection(DIMS, cfg, rl, dp_ranks=4, bandwidths_gbytes={"link": 2.0})
    n, S = proj["samples_per_rank"], rl.prompt_len + rl.response_len
    assert n == 3
    tokens = torch.randint(0, 100, (n, S), generator=gen)
    samples = split_batch(_batch(cfg, n, S, gen), tokens, version=0)
    routing = split_routing({i: torch.randint(0, DIMS.num_experts, (n, S, DIMS.topk), generator=gen)
                             for i in DIMS.moe_layers}, tokens, version=0, num_experts=DIMS.num_experts)
    routing = routing if replay else []
    assert proj["tokens_per_rank"] == sum(s.num_tokens for s in samples) == 15
    assert proj["guidance_bytes_per_rank"] == sum(s.guidance_nbytes() for s in samples)
    assert proj["cache_host_bytes_per_rank"] == rl.steps_in_flight * plan_flat(samples).total
    assert proj["routing_bytes_per_rank"] == plan_routing(routing)[1]  # 0 without replay: nothing to send
    payload = _encode(samples, routing)[2]
    assert proj["sync_payload_bytes_per_rank"] == payload.numel()
    assert proj["sync_seconds"]["link"] == payload.numel() / 2e9
    assert shard_bytes(DIMS, cfg, [S] * n)["samples"] == n  # samples of one length count once each


def test_sync_payload_without_routing_lays_sites_out_as_the_wire(gen):
    """Without routing replay the payload ends with the last guidance field (unpadded): the planner must lay the
    columns out in the wire's (layer, site) order whatever order ``guided_sites`` names them in (here the last field
    is layer 2's K/V amax, 80 bytes; FC1's, 40 bytes, would end the payload 8 bytes earlier)."""
    cfg = TraceConfig(guided_layers="all", routing_replay=False, guided_sites=("kv_v", "expert_fc1_in"))
    B, S = 2, 5
    tokens = torch.randint(0, 100, (B, S), generator=gen)
    samples = split_batch(_batch(cfg, B, S, gen), tokens, version=0)
    assert _encode(samples)[2].numel() == shard_bytes(DIMS, cfg, [S] * B)["sync_payload"]


def test_sync_header_bound_holds_for_samples_of_several_lengths(gen):
    """The header names each sample's token count: for lengths of one and two digits the bound is the real header
    plus only what it leaves open (int64-wide ids and versions, offsets as wide as the payload)."""
    cfg = TraceConfig(guided_layers="all")
    B, S, lengths = 3, 12, [12, 10, 3]
    tokens = torch.randint(0, 100, (B, S), generator=gen)
    samples = split_batch(_batch(cfg, B, S, gen), tokens, version=7, lengths=lengths, sample_ids=[5, 123, 40])
    routing = split_routing({i: torch.randint(0, DIMS.num_experts, (B, S, DIMS.topk), generator=gen)
                             for i in DIMS.moe_layers}, tokens, version=7, num_experts=DIMS.num_experts,
                            lengths=lengths, sample_ids=[5, 123, 40])
    _, header, payload = _encode(samples, routing)
    head = json.loads(bytes(header.tolist()))
    assert head["guidance"]["table"]["tokens"] == lengths
    bound = sync_header_bound(DIMS, cfg, lengths)
    fields = [f for sec in ("guidance", "routing") for c in head[sec]["columns"] for f in c["fields"]]
    table = head["guidance"]["table"]
    slack = (sum(2 * 20 - len(str(i)) - len(str(v)) for i, v in zip(table["ids"], table["versions"]))
             + sum(len(str(payload.numel())) - len(str(f[3])) for f in fields))
    assert bound - header.numel() == slack
