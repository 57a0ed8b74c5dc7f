"""Expert parallelism (2 processes, gloo): EP=2 with the allgather and alltoall dispatchers equals EP=1 for the
same weights and tokens, with and without guidance; FC2 guidance reaches the rank that computes each row."""

import dataclasses
import os

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.megatron import StepGuidance, trace_guidance, trace_spec
from megatron_trace.megatron.rows import map_record
from megatron_trace.testing.megatron_cpu import spawn_ranks

from ._dist import ep_worker, features_worker, tp_worker
from .harness import TOPK, batch, build_model, free_port, perturb_non_experts, stock_spec, tiny_config

pytestmark = [pytest.mark.usefixtures("world1"), pytest.mark.slow]

WORLD = 2
TC = TraceConfig(guided_layers="last_k", guided_last_k=3)
PER_TENSOR_FC1 = TraceConfig(sites=("expert_fc1_in", "weights"), guided_sites=("expert_fc1_in",),
                             activation_amax="per_tensor")


def _record(model, data, step=None):
    tokens, pos, mask, _ = data
    with trace_guidance(model, step, record=True, compact=False) as h, torch.no_grad():
        logits = model(tokens, pos, mask)
    return {"logits": logits, "recorded": h.recorded(), "counter": h.counter}


@pytest.fixture(scope="module")
def ep1(tmp_path_factory):
    """EP=1 references for batches 0 and 1, and the files the workers read."""
    workdir = tmp_path_factory.mktemp("ep")
    cfg = tiny_config()
    model = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    perturb_non_experts(rollout, 0.01)
    modes, refs = {}, []  # mode -> each rank's guidance (None: no guidance)
    for rank in range(WORLD):
        data = batch(seed=rank)
        roll = _record(rollout, data)["recorded"]
        guided = {"sites": roll.sites, "routing": roll.routing}
        # rank 1's rows of layer 3 partly invalid (both sites, FC1 only or FC2 only), or its FC1 rows of layer 3 all
        # valid but one position short of the batch (not used: shape); rank 0's all valid: its experts must not take
        # rank 1's rows as valid
        for mode, g in (("rne", None), ("guided", guided),
                        ("invalid", _invalid_rows(guided, 3) if rank == 1 else guided),
                        ("fc1_invalid", _invalid_rows(guided, 3, ("expert_fc1_in",)) if rank == 1 else guided),
                        ("fc2_invalid", _invalid_rows(guided, 3, ("expert_fc2_in",)) if rank == 1 else guided),
                        ("fc1_short", _short_rows(guided, 3, "expert_fc1_in") if rank == 1 else guided),
                        ("no_replay", {"sites": roll.sites, "routing": {}})):  # the trainer routes itself
            modes.setdefault(mode, []).append(g)
        refs.append({mode: _record(model, data, None if g[rank] is None else StepGuidance(**g[rank]))
                     for mode, g in modes.items()})
        pt = build_model(cfg, trace_spec(stock_spec(cfg), PER_TENSOR_FC1))
        pt.load_state_dict(model.state_dict())
        with torch.no_grad():
            refs[-1]["per_tensor_fc1"] = pt(*data[:3])
    torch.save({"trace_config": TC, "per_tensor_fc1": PER_TENSOR_FC1, "state_dict": model.state_dict(),
                "modes": modes}, workdir / "shared.pt")
    return workdir, refs


def _invalid_rows(guidance: dict, layer: int, which=("expert_fc1_in", "expert_fc2_in")) -> dict:
    """``guidance`` with batch row 0's MoE records (of sites ``which``) of ``layer`` invalid and zeroed (rows the
    rollout did not record)."""
    sites = dict(guidance["sites"])
    for site in which:
        sg = sites[(layer, site)]
        codes, valid = sg.record.codes.clone(), sg.valid.clone()
        codes[0], valid[0] = 0, False
        sites[(layer, site)] = dataclasses.replace(sg, record=dataclasses.replace(sg.record, codes=codes), valid=valid)
    return {**guidance, "sites": sites}


def _short_rows(guidance: dict, layer: int, site: str) -> dict:
    """``guidance`` with ``site``'s record of ``layer`` one position shorter than the batch, every row valid."""
    sg = guidance["sites"][(layer, site)]
    rec = map_record(sg.record, lambda t: t[:, :-1], (sg.record.shape[0], sg.record.shape[1] - 1, *sg.record.shape[2:]))
    ids = None if sg.expert_ids is None else sg.expert_ids[:, :-1]
    short = dataclasses.replace(sg, record=rec, valid=sg.valid[:, :-1], expert_ids=ids)
    return {**guidance, "sites": {**guidance["sites"], (layer, site): short}}


def _invalid_kv_rows(guidance: dict, layer: int, site: str, n: int) -> dict:
    """``guidance`` with the first ``n`` tokens of batch row 0 invalid and zeroed at a KV ``site`` of ``layer``."""
    sg = guidance["sites"][(layer, site)]
    codes, valid = sg.record.codes.clone(), sg.valid.clone()
    codes[0, :n], valid[0, :n] = 0, False
    bad = dataclasses.replace(sg, record=dataclasses.replace(sg.record, codes=codes), valid=valid)
    return {**guidance, "sites": {**guidance["sites"], (layer, site): bad}}


def _spawn(target, workdir, *args) -> list[dict]:
    port = free_port()
    codes = spawn_ranks(target, WORLD, lambda r: (r, WORLD, port, *args, str(workdir)), timeout=240)
    errors = [(workdir / f"error{r}.txt") for r in range(WORLD)]
    msgs = [e.read_text() for e in errors if e.exists()]
    assert not msgs and all(c == 0 for c in codes), msgs or codes
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _same_records(a, b):
    assert sorted(a.sites) == sorted(b.sites)
    for key in a.sites:
        ra, rb = a.sites[key], b.sites[key]
        assert torch.equal(ra.valid, rb.valid), key
        assert torch.equal(ra.record.codes, rb.record.codes), key
        assert torch.equal(ra.record.block_scales.view(torch.uint8), rb.record.block_scales.view(torch.uint8)), key
        assert torch.equal(ra.record.global_amax, rb.record.global_amax), key
        if ra.expert_ids is not None:
            assert torch.equal(ra.expert_ids, rb.expert_ids), key
    assert all(torch.equal(a.routing[k], b.routing[k]) for k in a.routing)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_equals_ep1(ep1, dispatcher):
    workdir, refs = ep1
    for f in workdir.glob("rank*.pt"):
        os.remove(f)
    results = _spawn(ep_worker, workdir, dispatcher)
    for rank, (got, want) in enumerate(zip(results, refs)):
        for mode in (m for m in want if m != "per_tensor_fc1"):
            assert torch.equal(got[mode]["logits"], want[mode]["logits"]), (rank, mode)
            # the codes each rank used (FC2 rows travel back from the expert's rank to the token's rank)
            _same_records(got[mode]["recorded"], want[mode]["recorded"])
            assert got[mode]["counter"].used == want[mode]["counter"].used
            assert got[mode]["counter"].fallback == want[mode]["counter"].fallback
        assert got["guided"]["counter"].used > 0
        assert not torch.equal(got["guided"]["logits"], got["rne"]["logits"])  # guidance changed the forward
        if rank == 1:  # its layer 3 rows: some not used (invalid), or none (shape)
            assert got["fc1_invalid"]["counter"].fallback["invalid_row"] > 0
            assert got["fc2_invalid"]["counter"].fallback["invalid_row"] > 0
            assert got["fc1_short"]["counter"].fallback["shape"] > 0
        # per-tensor FC1 amax: EP 1's numbers in the context; outside it refused (it would be the received rows')
        assert torch.equal(got["per_tensor_fc1"], want["per_tensor_fc1"]), rank
        assert "activation_amax='per_tensor' with expert_model_parallel_size=2 needs the trace_guidance context" \
            in got["per_tensor_fc1_error"]


@pytest.mark.parametrize("features", [
    dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=2,
         moe_router_group_topk=1, moe_router_dtype="fp32", moe_router_topk_scaling_factor=2.0),
], ids=["shared_experts_overlap", "sigmoid_bias_group_limited_fp32_router"])
def test_ep2_with_megatron_moe_features_equals_ep1(tmp_path, features):
    """The alltoall dispatcher overlapping the shared experts with its communication, and a router with Megatron's
    score function, expert bias, group-limited top-k, fp32 dtype and top-k scaling: EP=2 computes, records and counts
    what EP=1 does, without guidance and guided by a rollout's records (rows moved by TRACE's own dispatcher)."""
    cfg_kw = {"moe_token_dispatcher_type": "alltoall", **features}
    cfg = tiny_config(**cfg_kw)
    model = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), TC))
    perturb_non_experts(rollout, 0.01)
    modes, refs = {"rne": None, "guided": []}, []
    for rank in range(WORLD):
        data = batch(seed=rank)
        roll = _record(rollout, data)["recorded"]
        modes["guided"].append({"sites": roll.sites, "routing": roll.routing})
        refs.append({"rne": _record(model, data),
                     "guided": _record(model, data, StepGuidance(**modes["guided"][rank]))})
    torch.save({"config": cfg_kw, "trace_config": TC, "state_dict": model.state_dict(), "modes": modes},
               tmp_path / "shared.pt")
    for rank, (got, want) in enumerate(zip(_spawn(features_worker, tmp_path), refs)):
        for mode in modes:
            assert torch.equal(got[mode]["logits"], want[mode]["logits"]), (rank, mode)
            _same_records(got[mode]["recorded"], want[mode]["recorded"])
            assert got[mode]["counter"].used == want[mode]["counter"].used
            assert got[mode]["counter"].fallback == want[mode]["counter"].fallback
        # last_k=3 layers, every row: FC1 and the two KV sites per token, FC2 per (token, expert)
        assert got["guided"]["counter"].used == 3 * (3 + TOPK) * data[0].numel()


@pytest.mark.parametrize("groups", [2, 1], ids=["kv-heads-split", "kv-head-replicated"])
def test_tensor_and_sequence_parallel_slice_guidance_like_the_tokens(tmp_path, groups):
    """TP=2 + sequence parallel: each rank takes its sequence shard of the MoE guidance and routing and its KV
    heads; logits match TP=1 up to the reduction order (a wrong slice would put other tokens' scales here).
    With 1 KV head (< TP) Megatron replicates it on both ranks (and tells core attention 2 groups)."""
    tc = TraceConfig(guided_layers="all")
    cfg = tiny_config(num_query_groups=groups)
    model = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    rollout = build_model(cfg, trace_spec(stock_spec(cfg), tc))
    perturb_non_experts(rollout, 0.01)
    data = batch(seed=0)
    roll = _record(rollout, data)["recorded"]
    guidance = {"sites": roll.sites, "routing": roll.routing}
    kv_invalid = _invalid_kv_rows(guidance, 0, "kv_k", 2)
    ref = {"rne": _record(model, data, StepGuidance(routing=roll.routing)),
           "guided": _record(model, data, StepGuidance(**guidance)),
           "kv_invalid": _record(model, data, StepGuidance(**kv_invalid))}
    token_mask = torch.ones(data[0].shape, dtype=torch.bool)
    token_mask[0, -3:] = False  # padding in rank 1's sequence shard only
    torch.save({"trace_config": tc, "guidance": guidance, "groups": groups, "token_mask": token_mask,
                "kv_invalid": kv_invalid}, tmp_path / "shared.pt")
    results = _spawn(tp_worker, tmp_path)
    vocab = ref["rne"]["logits"].shape[-1] // WORLD
    for rank, got in enumerate(results):
        errs = {}
        for mode in ("rne", "guided", "kv_invalid"):
            want = ref[mode]["logits"][..., rank * vocab : (rank + 1) * vocab].float()
            errs[mode] = ((got[mode]["logits"].float() - want).norm() / want.norm()).item()
        # guided: both runs reproduce the rollout's codes, so they agree at least as well as the RNE runs do
        assert errs["guided"] < 0.02 and errs["kv_invalid"] < 0.02 and errs["rne"] < 0.1, errs
        # KV rows not all valid (per-token flags, every token on every rank), before the MoE layer's local rows
        assert got["kv_invalid"]["counter"].fallback == {"invalid_row": 2}, got["kv_invalid"]["counter"].fallback
        # MoE rows: this rank's sequence shard; KV rows: every token (attention sees the whole sequence)
        tokens = data[0].numel()
        assert got["guided"]["counter"].used == 4 * (tokens // WORLD * (1 + TOPK) + 2 * tokens)
        assert not got["guided"]["counter"].fallback
        # padding is not counted: rank 1's MoE rows lose its 3 padding tokens' (its own shard of the mask), rank 0's
        # none; KV rows: the same on both ranks (every token)
        masked = [r["masked"]["counter"].used for r in results]
        assert masked[0] - masked[1] == 4 * 3 * (1 + TOPK), masked
        assert masked[0] < got["guided"]["counter"].used and not got["masked"]["counter"].fallback
        # a KV-only config: recording (this rank's heads only) and one amax over this rank's heads are refused
        assert got["record_error"] == "recording needs tensor_model_parallel_size=1 (a rank holds only its KV heads)"
        # and a MoE-only one: a rank's MoE layer sees its sequence shard of the tokens only
        assert got["moe_record_error"] == "recording needs tensor_model_parallel_size=1"
        assert "activation_amax='per_tensor' at the KV sites with tensor_model_parallel_size=2" in \
            got["per_tensor_error"]
