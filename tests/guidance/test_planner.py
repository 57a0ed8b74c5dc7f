import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_trace.cli import plan
from megatron_trace.config import ACTIVATION_SITES, TraceConfig
from megatron_trace.guidance.accounting import bytes_per_layer, bytes_per_token, elements_per_layer, side_bytes
from megatron_trace.guidance.model_dims import ModelDims
from megatron_trace.guidance.planner import RLSettings, budget_layers, plan_row, shard_bytes
from megatron_trace.guidance.selection import guided_layers

DATA = Path(__file__).parent.parent / "data"
Q35 = DATA / "qwen3_5_35b_a3b_like_config.json"
KIB = 1024


# ---- fixed policies ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw,want", [
    (dict(guided_layers="none"), ()),
    (dict(guided_layers="all"), tuple(range(8))),
    (dict(guided_layers="last_k", guided_last_k=3), (5, 6, 7)),
    (dict(guided_layers="fraction", guided_fraction=0.5), (4, 5, 6, 7)),
    (dict(guided_layers="fraction", guided_fraction=0.3), (5, 6, 7)),  # ceil(2.4) = 3 deepest
    (dict(guided_layers="explicit", guided_layer_list=(6, 1, 1)), (1, 6)),
    (dict(enabled=False), ()),
], ids=["none", "all", "last_k", "fraction-half", "fraction-ceil", "explicit", "disabled"])
def test_fixed_policies(kw, want):
    assert guided_layers(TraceConfig(**kw), 8) == want


@pytest.mark.parametrize("fraction,layers,k", [(0.28, 25, 7), (0.14, 50, 7), (0.56, 50, 28), (0.68, 75, 51),
                                               (0.281, 25, 8)])
def test_fraction_is_taken_as_written(fraction, layers, k):
    # in binary floating point 0.28 * 25 = 7.000000000000001, whose ceil would guide one layer too many
    assert guided_layers(TraceConfig(guided_layers="fraction", guided_fraction=fraction), layers) == tuple(
        range(layers - k, layers))


@pytest.mark.parametrize("num_layers,want", [(7, (3, 4, 5, 6)), (61, tuple(range(30, 61))), (1, (0,))])
def test_the_default_policy_guides_the_deepest_half_rounded_up(num_layers, want):
    """The default (``fraction`` 0.5): the deepest ceil(L / 2) layers; an odd depth guides the middle layer too
    (DeepSeek-V3's 61: 31 layers, 30..60)."""
    assert guided_layers(TraceConfig(), num_layers) == want


def test_layer_policy_bounds_take_the_whole_model_and_name_what_is_beyond_it():
    assert guided_layers(TraceConfig(guided_layers="last_k", guided_last_k=8), 8) == tuple(range(8))
    with pytest.raises(ValueError, match="guided_last_k=9 exceeds num_layers=8"):
        guided_layers(TraceConfig(guided_layers="last_k", guided_last_k=9), 8)
    assert guided_layers(TraceConfig(guided_layers="explicit", guided_layer_list=(0, 7)), 8) == (0, 7)
    with pytest.raises(ValueError, match=r"guided_layer_list has layer\(s\) \[8\] beyond num_layers=8 \(valid 0..7\)"):
        guided_layers(TraceConfig(guided_layers="explicit", guided_layer_list=(0, 8)), 8)
    with pytest.raises(ValueError, match="num_layers=0 must be an int >= 1"):
        guided_layers(TraceConfig(), 0)


BUDGET = TraceConfig(guided_layers="budget", budget_bytes_per_token=100.0)


@pytest.mark.parametrize("num_layers", [0, -1, 2.5, "4", True, None], ids=repr)
@pytest.mark.parametrize("policy", ["guided_layers", "budget_layers"])
def test_a_bad_layer_count_is_named_by_both_policies(policy, num_layers):
    """(were: budget_layers(0 or -1) chose no layer, silently; 2.5 / "4" / None a bare TypeError; True one layer)"""
    call = (lambda n: guided_layers(TraceConfig(), n)) if policy == "guided_layers" else \
        (lambda n: budget_layers(BUDGET, n, mismatch_profile=0.1, bytes_per_layer=10))
    with pytest.raises(ValueError, match=rf"num_layers={re.escape(repr(num_layers))} must be an int >= 1"):
        call(num_layers)
    assert call(4) == (0, 1, 2, 3) if policy == "budget_layers" else call(4) == (2, 3)


# ---- budget policy -----------------------------------------------------------------------------
def test_budget_ranks_rates_by_rate_and_masses_by_mass_per_byte():
    """A rate is a fraction of the layer's elements, so guiding layer i removes rate x (elements ~ bytes): the value
    per byte is the rate. (This test used to expect (1, 2, 3) for the rates: it read them as masses, valuing layer
    4's 0.9 of 300 bytes below layer 1's 0.1 of 100. That reading is kept, explicitly, as ``profile_unit="mass"``.)"""
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=300)
    profile = [0.0, 0.1, 0.5, 0.2, 0.9]
    cost = [100, 100, 100, 50, 300]
    # rates: 4 (0.9 x 300 = 270 removed) fills the budget; 1, 2, 3 together remove 10 + 50 + 10 = 70
    assert guided_layers(cfg, 5, mismatch_profile=profile, bytes_per_layer=cost) == (4,)
    # masses: densities 1:0.001 2:0.005 3:0.004 4:0.003 -> 2 (100), 3 (150), 4 no (450 > 300), 1 (250)
    assert guided_layers(cfg, 5, mismatch_profile=profile, bytes_per_layer=cost, profile_unit="mass") == (1, 2, 3)
    for unit in ("rate", "mass"):  # equal costs: both readings rank by the profile
        assert budget_layers(cfg, 5, mismatch_profile=dict(enumerate(profile)), bytes_per_layer=100,
                             profile_unit=unit) == (2, 3, 4)


def test_budget_rates_weigh_each_layers_elements_per_byte():
    """With ``elements_per_layer`` (``plan_row`` passes it) a rate weighs the elements each byte carries: layer 1's
    bytes carry fewer elements (short rows, each with its 4-byte amax), so at equal rates layer 0 goes first."""
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=100)
    kw = dict(mismatch_profile=[0.1, 0.1], bytes_per_layer=100)
    assert budget_layers(cfg, 2, **kw) == (1,)  # a tie without elements: the deeper layer
    assert budget_layers(cfg, 2, elements_per_layer=[500, 400], **kw) == (0,)


def test_budget_ties_prefer_deeper_layers():
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=200)
    for unit in ("rate", "mass"):
        assert budget_layers(cfg, 6, mismatch_profile=[1.0] * 6, bytes_per_layer=100, profile_unit=unit) == (4, 5)


@pytest.mark.parametrize("kw,match", [
    ({"bytes_per_layer": [5.9, 5.9]}, r"bytes_per_layer holds 5.9 at layer 0: each value must be a whole number"),
    ({"bytes_per_layer": 5.9}, r"bytes_per_layer holds 5.9 \(for every layer\): each value must be a whole number"),
    ({"bytes_per_layer": [4, float("nan")]}, r"bytes_per_layer holds nan at layer 1: each value must be a whole"),
    ({"bytes_per_layer": {0: float("inf"), 1: 4}}, r"bytes_per_layer holds inf at layer 0"),
    ({"bytes_per_layer": [4, 4], "elements_per_layer": [float("inf"), 3]}, r"elements_per_layer holds inf at layer 0"),
], ids=["fraction", "fraction-scalar", "nan", "inf", "elements-inf"])
def test_budget_counts_must_be_whole_numbers(kw, match):
    """Byte and element counts are counts: 5.9 bytes per layer used to be truncated to 5 (both layers taken under a
    10-byte budget: 11.8 bytes, over it), NaN / Inf ended in int()'s ValueError / OverflowError naming nothing."""
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=10)
    with pytest.raises(ValueError, match=match):
        budget_layers(cfg, 2, mismatch_profile=[0.5, 0.5], **kw)
    assert budget_layers(cfg, 2, mismatch_profile=[0.5, 0.5], bytes_per_layer=[5.0, 6]) == (1,)  # (whole floats)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 5000)), min_size=1, max_size=40),
    budget=st.floats(1, 60_000),
    unit=st.sampled_from(["rate", "mass"]),
)
def test_budget_never_exceeds(data, budget, unit):
    profile, cost = [p for p, _ in data], [c for _, c in data]
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=budget)
    layers = budget_layers(cfg, len(data), mismatch_profile=profile, bytes_per_layer=cost, profile_unit=unit)
    assert sum(cost[i] for i in layers) <= budget
    assert all(profile[i] > 0 for i in layers)
    # maximal: nothing left out with mismatch > 0 would still fit
    used = sum(cost[i] for i in layers)
    assert all(used + cost[i] > budget for i in range(len(data)) if i not in layers and profile[i] > 0)


def test_budget_errors_are_clear():
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=100)
    with pytest.raises(ValueError, match="mismatch_profile for each of the 4 layers") as err:
        guided_layers(cfg, 4)
    assert "README: Reading the metrics" in str(err.value)  # (it named a METRICS.md, which does not exist)
    with pytest.raises(ValueError, match="3 entries, expected num_layers=4"):
        budget_layers(cfg, 4, mismatch_profile=[0.1] * 3, bytes_per_layer=10)
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        budget_layers(cfg, 4, mismatch_profile={0: 1, 1: 1, 2: 1}, bytes_per_layer=10)
    with pytest.raises(ValueError, match="finite"):
        budget_layers(cfg, 2, mismatch_profile=[float("nan"), 0.1], bytes_per_layer=10)
    with pytest.raises(ValueError, match="bytes_per_layer"):
        budget_layers(cfg, 2, mismatch_profile=[0.1, 0.1])
    # a rate above 1 is a mass (or a percentage) given as a rate
    with pytest.raises(ValueError, match=r"fractions in \[0, 1\].*\(1, 3\.5\).*profile_unit='mass'"):
        budget_layers(cfg, 2, mismatch_profile=[0.1, 3.5], bytes_per_layer=10)
    assert budget_layers(cfg, 2, mismatch_profile=[0.1, 3.5], bytes_per_layer=10, profile_unit="mass") == (0, 1)
    with pytest.raises(ValueError, match=r"budget_bytes_per_token=0.0 must be > 0 for the budget policy"):
        budget_layers(TraceConfig(), 2, mismatch_profile=[0.1, 0.1], bytes_per_layer=0)  # (the default: 0)
    with pytest.raises(ValueError, match=r"profile_unit='ratio' is not one of \('rate', 'mass'\)"):
        budget_layers(cfg, 2, mismatch_profile=[0.1, 0.1], bytes_per_layer=10, profile_unit="ratio")


def test_budget_with_real_layer_bytes_of_a_hybrid_model():
    """Qwen3.5: every 4th layer also has a KV cache, so it costs more. Mismatch rates growing with depth guide the
    deepest layers, 39 first (its rate is the highest; the KV adds bytes and as many elements). This test used to
    expect max(layers) == 38: read as masses, the rates made the dearer layer 39 worth less per byte than 38."""
    dims = ModelDims.from_hf_config(Q35)
    cfg = TraceConfig(guided_layers="budget", budget_bytes_per_token=4000, cache_mode="compact")
    cost = bytes_per_layer(dims, cfg.guided_sites, compact=True)
    profile = [0.01 * (i + 1) for i in range(40)]  # mismatch grows with depth
    layers = budget_layers(cfg, 40, mismatch_profile=profile, bytes_per_layer=cost,
                           elements_per_layer=elements_per_layer(dims, cfg.guided_sites))
    assert bytes_per_token(dims, cfg.guided_sites, layers, compact=True) <= 4000
    assert layers == (37, 38, 39)  # 1396 + 1188 + 1188 bytes; 36 (1188 more) does not fit
    masses = budget_layers(cfg, 40, mismatch_profile=profile, bytes_per_layer=cost, profile_unit="mass")
    assert max(masses) == 38  # the deepest MoE-only layer is cheapest per unit of mass


def test_uniform_rates_on_deepseek_v3_guide_the_deepest_moe_layers_not_the_dense_layers_kv():
    """DeepSeek-V3's first 3 layers are dense: only their MLA KV row (112 bytes compact) is guided, against 4564
    bytes of an MoE layer. Uniform rates read as masses made that cheap KV the best value per byte, so a budget of
    10 MoE layers guided layers 0, 1, 2 and only 9 MoE layers. As rates, each byte removes as much everywhere (the
    MoE rows' elements per byte are even a little higher): the 10 deepest layers."""
    dims = ModelDims.from_hf_config(DATA / "deepseek_v3_config.json")
    cost = bytes_per_layer(dims, TraceConfig().guided_sites, compact=True)
    assert (cost[0], cost[3]) == (112, 4564)
    cfg = TraceConfig(guided_layers="budget", cache_mode="compact", budget_bytes_per_token=10 * cost[3])
    row = plan_row(dims, cfg, RLSettings(), "budget", mismatch_profile=[0.02] * 61)
    assert row["layers"] == list(range(51, 61)) and row["bytes_per_token"] == 10 * 4564
    assert budget_layers(cfg, 61, mismatch_profile=0.02, bytes_per_layer=cost) == tuple(range(51, 61))
    assert budget_layers(cfg, 61, mismatch_profile=0.02, bytes_per_layer=cost, profile_unit="mass") == (
        0, 1, 2, *range(52, 61))  # the old reading, kept for per-layer masses
    # room for the dense layers too: they come last, filling what the MoE layers leave
    cfg = cfg.replace(budget_bytes_per_token=10 * cost[3] + 3 * cost[0])
    assert plan_row(dims, cfg, RLSettings(), "budget", mismatch_profile=[0.02] * 61)["layers"] == [
        0, 1, 2, *range(51, 61)]


@pytest.mark.parametrize("name,sites,empty,kept", [
    ("qwen3_5_35b_a3b_like", ("kv_k", "kv_v"), (0, 1), 3),  # linear-attention layers 0, 1: no KV cache
    ("deepseek_v3", ("expert_fc1_in", "expert_fc2_in"), (0, 2), 3),  # first_k_dense_replace 3: no routed experts
], ids=["qwen3.5-kv-on-linear-attention", "deepseek-experts-on-dense"])
@pytest.mark.parametrize("path", ["plan_row", "shard_bytes", "cli"])
def test_explicit_layers_without_the_guided_sites_are_refused_by_name(name, sites, empty, kept, path, capsys):
    """An explicit layer list naming layers that have none of the guided sites was planned at 0 bytes for them, the
    row still saying it guided them (plan_row, the sizes under it, ``plan --layer-policy explicit=...``)."""
    dims = ModelDims.from_hf_config(DATA / f"{name}_config.json")
    assert not any(dims.has_site(i, s) for i in empty for s in sites) and all(dims.has_site(kept, s) for s in sites)
    cfg = TraceConfig(guided_sites=sites, guided_layers="explicit", guided_layer_list=(*empty, kept))
    want = rf"guided_layer_list has layer\(s\) \[{empty[0]}, {empty[1]}\], which would guide nothing"
    if path == "cli":
        policy = "explicit=" + ",".join(map(str, cfg.guided_layer_list))
        assert plan.main(["--hf-config", str(DATA / f"{name}_config.json"), "--sites", ",".join(sites),
                          "--layer-policy", policy, "--modes", "compact"]) == 2
        assert re.search(want, capsys.readouterr().err)
        return
    call = {"plan_row": lambda c: plan_row(dims, c, RLSettings(), "explicit"),
            "shard_bytes": lambda c: shard_bytes(dims, c, [8])}[path]
    with pytest.raises(ValueError, match=want):
        call(cfg)
    row = plan_row(dims, cfg.replace(guided_layer_list=(kept,)), RLSettings(), "explicit")  # what it does guide
    assert row["layers"] == [kept] and row["bytes_per_token"] == bytes_per_token(dims, sites, [kept], compact=True)


@pytest.mark.parametrize("name,pattern", [("qwen3_5_35b_a3b_like", "model.layers.0.self_attn.kv_cache"),
                                          ("deepseek_v3", "model.layers.2.mlp.experts")],
                         ids=["qwen3.5-linear-attention-kv", "deepseek-dense-experts"])
def test_an_exclude_pattern_naming_a_module_the_model_lacks_is_refused_by_name(name, pattern):
    """Layer 0 of Qwen3.5 has no KV cache, layer 2 of DeepSeek-V3 no routed experts: the pattern excluded nothing, and
    the plan went on as if it did (the rollout and trainer refuse it)."""
    dims = ModelDims.from_hf_config(DATA / f"{name}_config.json")
    with pytest.raises(ValueError, match=rf"exclude_modules pattern '{re.escape(pattern)}' matches none"):
        plan_row(dims, TraceConfig(guided_layers="all", exclude_modules=(pattern,)), RLSettings(), "all")
    layer = pattern.split(".")[2]
    real = pattern.replace(f".{layer}.", ".3.")  # layer 3 has both
    assert plan_row(dims, TraceConfig(guided_layers="all", exclude_modules=(real,)), RLSettings(), "all")["layers"]


@pytest.mark.parametrize("mode", ["compact", "full"])
def test_modules_kept_in_bf16_are_planned_as_the_sites_they_leave(mode):
    """Experts ``exclude_modules`` keeps in BF16 record nothing (the rollouts skip their sites), but were sized as
    guided: with every expert excluded the row is the KV-only row, routing (every router still runs) included."""
    dims = ModelDims.from_hf_config(Q35)
    rl = RLSettings(trajectories=3, prompt_len=5, response_len=7)
    cfg = TraceConfig(guided_layers="all", cache_mode=mode, exclude_modules=("model.layers.*.mlp.experts",))
    kv_only = TraceConfig(guided_layers="all", cache_mode=mode, guided_sites=("kv_k", "kv_v"))
    assert plan_row(dims, cfg, rl, "all") == plan_row(dims, kv_only, rl, "all")
    assert plan_row(dims, cfg, rl, "all")["bytes_per_token"] < plan_row(dims, cfg.replace(exclude_modules=()), rl,
                                                                        "all")["bytes_per_token"]


def test_plan_row_weighs_uniform_rates_by_each_layers_elements_per_byte():
    """Qwen3.5 at one rate everywhere, 3600 bytes/token (compact): a full-attention layer's K/V rows carry fewer
    elements per byte (256-element rows, each with its 4-byte amax) than its FC1/FC2 rows, so three MoE-only layers
    (36, 37, 38: 3564 bytes, 18432 elements) remove more mismatch than the deepest two (38, 39: 2584 bytes,
    13312 elements), which a tie on the rate alone would take."""
    dims = ModelDims.from_hf_config(Q35)
    cfg = TraceConfig(guided_layers="budget", cache_mode="compact", budget_bytes_per_token=3600)
    row = plan_row(dims, cfg, RLSettings(), "budget", mismatch_profile=[0.02] * 40)
    elems = elements_per_layer(dims, cfg.guided_sites)
    assert row["layers"] == [36, 37, 38] and row["bytes_per_token"] == 3564 <= 3600
    assert sum(elems[i] for i in row["layers"]) == 18432 > elems[38] + elems[39] == 13312


# ---- planner numbers vs the paper (Qwen3.5-35B-A3B: ~50 KB full, ~7.5 KB compact last 20) --------
def _bpt(sites, layers, compact, amax="per_row"):
    dims = ModelDims.from_hf_config(Q35)
    return bytes_per_token(dims, sites, layers, fmt="nvfp4", compact=compact, amax=amax)


def test_paper_full_50kb_is_fc1_plus_kv_all_layers():
    """~45 KB activations = FC1 rows (2048 x 4.5 bit x 40 layers); ~5.6 KB KV = 10 full-attention
    layers x 2 heads x 256 x 2 (K, V) x 4.5 bit; FC2 input is not in the paper's figure."""
    assert _bpt(["expert_fc1_in"], range(40), False, "per_tensor") == 45 * KIB
    assert _bpt(["kv_k", "kv_v"], range(40), False, "per_tensor") == 5760  # 5.6 KiB
    full = _bpt(["expert_fc1_in", "kv_k", "kv_v"], range(40), False)
    assert full == 52160 and abs(full / (50 * KIB) - 1) < 0.02  # with 4-byte per-row amax


def test_paper_compact_7_5kb_is_fc1_last_20_layers():
    assert _bpt(["expert_fc1_in"], range(20, 40), True, "per_tensor") == 7.5 * KIB
    compact = _bpt(["expert_fc1_in"], range(20, 40), True)
    assert compact == 7760 and abs(compact / (7.5 * KIB) - 1) < 0.04
    # with KV too: 8800 B; full / compact at the same sites = exactly 6x (3x bits, 2x layers) w/o amax
    assert _bpt(["expert_fc1_in", "kv_k", "kv_v"], range(20, 40), True) == 8800
    assert _bpt(["expert_fc1_in", "kv_k", "kv_v"], range(40), False, "per_tensor") == 6 * _bpt(
        ["expert_fc1_in", "kv_k", "kv_v"], range(20, 40), True, "per_tensor")


def test_all_four_sites_are_much_larger_than_the_paper_figure():
    """FC2 input = top-8 rows of 512 per token per layer: 2x the FC1 bytes; all four sites ~142 KiB."""
    sites = ["expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v"]
    assert _bpt(sites, range(40), False) == 145600
    assert _bpt(sites, range(20, 40), True) == 20 * (388 + 8 * (96 + 4)) + 5 * 2 * 2 * (48 + 4)


def test_paper_51tb_per_step():
    """4096 trajectories x 256K tokens x 52160 B (FC1+KV, full; a per-tensor amax is recorded on every row,
    4 B each: 51840 B without it) ~ 51 TB."""
    dims = ModelDims.from_hf_config(Q35)
    cfg = TraceConfig(guided_layers="all", cache_mode="full", activation_amax="per_tensor",
                      guided_sites=("expert_fc1_in", "kv_k", "kv_v"))
    row = plan_row(dims, cfg, RLSettings(trajectories=4096, prompt_len=0, response_len=256 * 1024), "all")
    assert row["bytes_per_token"] == 52160
    assert abs(row["bytes_per_step"] / 2**40 - 50.9) < 0.1  # TiB


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_table(capsys):
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "all", "--layer-policy", "last_k=20"]) == 0
    out = capsys.readouterr().out
    assert "40 layers (40 MoE, 10 with KV)" in out
    lines = [ln for ln in out.splitlines() if ln.startswith(("all ", "last_k=20"))]
    assert len(lines) == 4 and "142.2 KiB" in lines[0]


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "qwen3_5_35b_a3b_like"])
def test_cli_json_matches_library(capsys, name):
    cfg_path = DATA / f"{name}_config.json"
    assert plan.main(["--hf-config", str(cfg_path), "--json", "--trajectories", "8", "--response-len", "100"]) == 0
    res = json.loads(capsys.readouterr().out)
    dims = ModelDims.from_hf_config(cfg_path)
    assert len(res["rows"]) == 2 * len(plan.DEFAULT_POLICIES)
    for row in res["rows"]:
        want = bytes_per_token(dims, ["expert_fc1_in", "expert_fc2_in", "kv_k", "kv_v"], row["layers"],
                               compact=row["mode"] == "compact")
        assert row["bytes_per_token"] == want
        assert row["bytes_per_step"] == want * 8 * (1024 + 100)
        # the cache and the sync carry more than the guidance: valid flags, FC2 expert ids (and routing, headers)
        side = sum(side_bytes(dims, layer, site) for layer in row["layers"] for site in ACTIVATION_SITES)
        assert row["host_bytes"] == (want + side) * 8 * (1024 + 100)
        assert row["sync_bytes"] > row["host_bytes"] or not row["layers"]
        assert row["sync_seconds"] == pytest.approx(row["sync_bytes"] * 8 / 400e9)


def test_cli_budget_policy(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps([0.01 * i for i in range(40)]))
    rc = plan.main(["--hf-config", str(Q35), "--json", "--layer-policy", "budget=20000", "--mismatch-profile",
                    str(prof), "--modes", "compact"])
    assert rc == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert 0 < row["bytes_per_token"] <= 20000
    # the table prints the chosen layers as --trace-guided-layers takes them
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "budget=20000", "--mismatch-profile", str(prof),
                      "--modes", "compact"]) == 0
    ids = ",".join(map(str, row["layers"]))
    assert (f"budget=20000 compact guides layers {ids}: --trace-format nvfp4 --trace-cache-mode compact "
            f"--trace-guided-layers {ids}") in capsys.readouterr().out


def test_cli_budget_layers_name_their_cache_mode(tmp_path, capsys):
    """Full and compact records cost different bytes, so one budget picks different layers per mode: each printed
    list says which --trace-cache-mode it was sized for."""
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps([0.01 * (i % 7 + 1) for i in range(40)]))
    argv = ["--hf-config", str(Q35), "--layer-policy", "budget=20000", "--mismatch-profile", str(prof)]
    assert plan.main([*argv, "--json"]) == 0
    rows = {r["mode"]: r["layers"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["full"] != rows["compact"]
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    for mode, layers in rows.items():
        ids = ",".join(map(str, layers))
        assert f"budget=20000 {mode} guides layers {ids}: --trace-format nvfp4 --trace-cache-mode {mode} " \
               f"--trace-guided-layers {ids}" in out
    assert plan.main([*argv, "--kv-format", "sglang_kvfp4", "--modes", "compact"]) == 0  # sized for SGLang's K/V
    assert ": --trace-format nvfp4 --trace-kv-format sglang_kvfp4 --trace-cache-mode compact" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "deepest"]) == 2
    assert "not one of none, all" in capsys.readouterr().err
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "budget=100"]) == 2
    assert "mismatch_profile" in capsys.readouterr().err
    assert plan.main(["--hf-config", "/nonexistent/config.json"]) == 2


@pytest.mark.parametrize("kw,match", [
    (dict(trajectories=float("nan")), r"trajectories=nan must be an int >= 1"),
    (dict(trajectories=2.5), r"trajectories=2.5 must be an int >= 1"),
    (dict(trajectories=True), r"trajectories=True must be an int >= 1"),
    (dict(prompt_len=float("nan")), r"prompt_len=nan must be an int >= 0"),
    (dict(response_len=float("nan")), r"response_len=nan must be an int >= 1"),
    (dict(steps_in_flight=float("nan")), r"steps_in_flight=nan must be an int >= 1"),
    (dict(bandwidth_gbps=float("inf")), r"bandwidth_gbps=inf must be a finite number > 0"),
    (dict(bandwidth_gbps=float("nan")), r"bandwidth_gbps=nan must be a finite number > 0"),
    (dict(bandwidth_gbps=-3.0), r"bandwidth_gbps=-3.0 must be a finite number > 0"),
], ids=["traj-nan", "traj-float", "traj-bool", "prompt-nan", "response-nan", "in-flight-nan", "bw-inf", "bw-nan",
        "bw-neg"])
def test_rl_settings_reject_nan_inf_and_non_int_values(kw, match):
    """A NaN passes every ``<`` check: it used to give NaN bytes per step (and an infinite link a 0 s sync)."""
    with pytest.raises(ValueError, match=match):
        RLSettings(**kw)


def test_cli_rejects_an_infinite_link(capsys):
    assert plan.main(["--hf-config", str(Q35), "--bandwidth-gbps", "inf"]) == 2
    assert "bandwidth_gbps=inf must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("text,match", [
    ("[0.1, null, 0.2]", r"mismatch_profile holds None at layer 1: each value must be a number"),
    ("[[0.1], 0.2]", r"mismatch_profile holds \[0.1\] at layer 0"),
    ('[0.1, "x"]', r"mismatch_profile holds 'x' at layer 1"),
    ('"0.5"', r"mismatch_profile='0.5' must be a number, a list of 40 numbers"),
    ("true", r"mismatch_profile=True must be a number"),
    ('{"layer_0": 0.1}', r"profile.json has key\(s\) \['layer_0'\]: a JSON object's keys are layer ids"),
], ids=["null", "nested", "string-value", "string", "bool", "key"])
def test_cli_names_a_bad_mismatch_profile_value(tmp_path, capsys, text, match):
    """A JSON profile with a null or a list in it used to end the CLI in a TypeError traceback; a string was read
    character by character ("010": rates 0, 1, 0), ``true`` as the rate 1.0 for every layer."""
    prof = tmp_path / "profile.json"
    prof.write_text(text)
    assert plan.main(["--hf-config", str(Q35), "--layer-policy", "budget=20000", "--mismatch-profile", str(prof),
                      "--modes", "compact"]) == 2
    assert re.search(match, capsys.readouterr().err)
